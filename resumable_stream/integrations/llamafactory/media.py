"""Multimodal SFT through LLaMA-Factory: every image a row names is checked by our VL transform's rules first
(confined, regular, bounded, decodable; ``bad_sample`` decides), so an unreadable file cannot stop the run
(docs/llamafactory.md, "Multimodal SFT")."""

from __future__ import annotations

from typing import Any

from ...config.transforms import TransformConfig
from ...errors import ConfigError
from ...transforms.errors import BadSample
from ...transforms.vl import load_processor, local_image_path, open_image, processor_digest, read_image_bytes

# keys of the ``resumable_stream:`` section about images (our data keys of the same name, see docs/vl.md)
MEDIA_KEYS = ("bad_sample", "max_image_bytes", "max_image_pixels", "allow_absolute_image_paths")


def media_settings(ours: dict[str, Any], media_dir: str | None = None) -> TransformConfig:
    """The image rules of the section's keys (ConfigError naming ``resumable_stream.KEY``), paths taken
    relative to ``media_dir``."""
    keys = {k: ours[k] for k in MEDIA_KEYS if k in ours}
    try:
        return TransformConfig(format="vl", image_dir=media_dir, **keys)
    except ConfigError as e:
        raise e.in_source("resumable_stream", set(keys)) from None


def checked_images(value: Any, cfg: TransformConfig) -> Any:
    """A row's images column as LLaMA-Factory is handed it: every image read (bounded) and decoded, a local path
    replaced by its real path inside ``media_dir``; BadSample naming the first one that cannot be used."""
    if value is None or value == []:
        return value
    images = value if isinstance(value, list) else [value]
    return [_checked(image, i, cfg) for i, image in enumerate(images)]


def _checked(value: Any, i: int, cfg: TransformConfig) -> Any:
    if isinstance(value, dict) and not value.get("bytes") and isinstance(value.get("path"), str):
        value = value["path"]           # LLaMA-Factory opens a path-only struct by its path
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        raise BadSample("skipped_image", f"image {i} is a URL ({value}); LLaMA-Factory opens images as local "
                                         "files (paths relative to media_dir)")
    open_image(read_image_bytes(value, i, cfg, None), i, cfg).close()    # its pixels bounded before decoding
    return local_image_path(value, i, cfg) if isinstance(value, str) else value


def placeholder_problem(row: dict[str, Any]) -> str | None:
    """Why LLaMA-Factory's mm_plugin would refuse a converted row's images (its ``_validate_messages``: as many
    ``<image>`` placeholders in the messages as images), or None. Rows its processor drops anyway (a prompt of
    even length, not one response) are left to it."""
    from llamafactory.extras.constants import IMAGE_PLACEHOLDER  # an optional extra, imported when used

    messages = row["_prompt"] + row["_response"]
    if len(row["_prompt"]) % 2 != 1 or len(row["_response"]) != 1:
        return None
    placeholders = sum(str(m["content"]).count(IMAGE_PLACEHOLDER) for m in messages)
    images = len(row.get("_images") or [])
    if placeholders == images:
        return None
    return f"{placeholders} {IMAGE_PLACEHOLDER} placeholder(s) in the messages but {images} image(s)"


def processor_fingerprint(processor) -> dict[str, Any]:
    """What decides the image tokens and pixels: the processor (tokenizer, image processor settings) and the
    limits LLaMA-Factory's patch_processor set on it from the model arguments (``image_max_pixels``, ...)."""
    limits = ("image_max_pixels", "image_min_pixels", "image_do_pan_and_scan", "crop_to_patches",
              "video_max_pixels", "video_min_pixels", "video_fps", "video_maxlen", "use_audio_in_video",
              "audio_sampling_rate")
    return {"digest": processor_digest(processor),
            **{k: getattr(processor, k) for k in limits if isinstance(getattr(processor, k, None),
                                                                    (int, float, bool, str))}}


class ProcessorLoader:
    """Stands in for ``AutoProcessor`` in LLaMA-Factory's ``load_tokenizer``: its processor, or where only the
    video processor fails to build (torchvision), the same processor without it."""

    @staticmethod
    def from_pretrained(name: str, trust_remote_code: bool = False, **kwargs):
        return load_processor(name, trust_remote_code, **kwargs)
