"""Multimodal SFT under `resumable-stream llamafactory train` (issue 38 item 4): mllm_demo-style rows (sharegpt
``messages`` with ``<image>`` placeholders, ``images`` paths relative to dataset_dir) through LLaMA-Factory's
``qwen2_vl`` template, its mm_plugin and its MultiModalDataCollatorForSeq2Seq, on a tiny random-init Qwen2-VL:
losses equal llamafactory-cli's, a SIGKILLed run resumes exactly, bad images follow ``bad_sample``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from lf_helpers import (
    ENV,
    assert_losses_equal,
    consumed,
    llamafactory_cli_vl,
    losses,
    make_vl_data,
    make_vl_model,
    ours,
    vl_rows,
    write_yaml,
)
from training_helpers import complete_checkpoints, count_lines

from resumable_stream.errors import ConfigError
from resumable_stream.transforms.errors import TransformError

# llamafactory-cli in streaming mode needs dispatch_batches off for a VLM: accelerate's dispatcher slices every
# tensor of a batch to batch_size rows, pixel_values and the 3-D position_ids too (ours reads its own batches)
VL = {"template": "qwen2_vl", "dataset": "mllm", "cutoff_len": 512, "max_steps": 6, "save_steps": 6,
      "accelerator_config": {"dispatch_batches": False}}


@pytest.fixture(scope="module")
def vl_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("lf_vl")
    return make_vl_model(str(root / "tiny-qwen2-vl")), make_vl_data(str(root / "data"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_multimodal_losses_equal_those_of_llamafactory_cli(vl_assets, procs, tmp_path):
    """LoRA, shuffling off on both sides (buffer_size 1, one DataLoader worker): the same image tokens, pixels
    and mrope position ids, so every per-step loss equals llamafactory-cli's (images dropped or mis-counted would
    change the tokens and the losses from step 1)."""
    model, data = vl_assets
    keys = {**VL, "finetuning_type": "lora", "lora_rank": 4, "lora_target": "all"}    # as qwen2_5vl_lora_sft.yaml
    cli_yaml, cli_out = write_yaml(str(tmp_path), "cli", model, data, streaming=True, **keys)
    our_yaml, our_out = write_yaml(str(tmp_path), "ours", model, data, **keys)
    procs.start(cli_yaml, "cli", env=ENV, command=llamafactory_cli_vl(cli_yaml)).wait_ok(600)
    procs.start(our_yaml, "ours", env=ENV, command=ours(our_yaml)).wait_ok(600)
    reference = losses(cli_out)
    assert len(reference) == 6
    assert_losses_equal(reference, losses(our_out), 1e-6, "[qwen2_vl]")
    assert os.path.isfile(os.path.join(our_out, "adapter_model.safetensors"))
    assert os.path.isdir(os.path.join(our_out, "checkpoint-6", "stream_state"))


def _broken_data(data: str, tmp_path) -> str:
    """dataset_dir ``broken`` beside ``data``'s pictures: its rows, with every 7th one broken in another way."""
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copytree(os.path.join(data, "pictures"), broken / "pictures")     # a symlink out would be refused
    (broken / "cut.png").write_bytes(open(os.path.join(data, "pictures", "0.png"), "rb").read()[:60])
    (tmp_path / "outside.png").write_bytes(open(os.path.join(data, "pictures", "1.png"), "rb").read())
    bad = ["missing.png", "cut.png", "../outside.png", str(tmp_path / "outside.png")]
    rows = vl_rows(60)
    for n, i in enumerate(range(3, 60, 7)):
        rows[i]["images"][0] = bad[n % len(bad)]
    (broken / "mllm.json").write_text(json.dumps(rows))
    with open(os.path.join(data, "dataset_info.json"), encoding="utf-8") as f:
        (broken / "dataset_info.json").write_text(f.read())
    return str(broken)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sigkilled_multimodal_run_resumes_exactly_and_skips_bad_images(vl_assets, procs, tmp_path):
    """Full fine-tuning, shuffled, 2 DataLoader workers, a missing / cut / escaping / absolute image in every 7th row skipped
    (``bad_sample: skip``): killed after checkpoint-4 and started again, losses and consumed samples of every
    step equal an uninterrupted run's."""
    model, data = vl_assets
    broken = _broken_data(data, tmp_path)
    keys = {**VL, "max_steps": 10, "save_steps": 4, "buffer_size": 8, "dataloader_num_workers": 2}

    def yaml_for(name):
        section = {"consumed_log": os.path.join(str(tmp_path), name, "consumed"), "bad_sample": "skip"}
        return write_yaml(str(tmp_path), name, model, broken, resumable_stream=section, **keys)

    ref_yaml, ref_out = yaml_for("reference")
    reference = procs.start(ref_yaml, "reference", env=ENV, command=ours(ref_yaml)).wait_ok(600)
    for reason in ("file '", "not found", "cannot be decoded", "leads out of", "is absolute"):
        assert reason in reference.stderr, reason
    config, out = yaml_for("killed")
    log = os.path.join(out, "trainer_log.jsonl")
    run = procs.start(config, "killed", env=ENV, command=ours(config))
    run.wait_until(lambda: 4 in complete_checkpoints(out) and count_lines(log) >= 6, "checkpoint-4 + 2 steps")
    run.kill()
    restart = procs.start(config, "restart", env=ENV, command=ours(config)).wait_ok(600)
    assert f"Resuming training from {os.path.join(out, 'checkpoint-4')}." in restart.stdout + restart.stderr
    assert_losses_equal(losses(ref_out), losses(out), 0.0, "[multimodal, killed after checkpoint-4]")
    assert consumed(ref_out) == consumed(out)
    assert len(losses(out)) == 10


# ------------------------------------------------------------------------------------------- in-process (fast)
def _transform(model: str, data: str, ours_section: dict):
    """Our transform over dataset ``mllm`` of ``data`` with LLaMA-Factory's qwen2_vl template and the model's
    processor, as `resumable-stream llamafactory train` builds them."""
    import llamafactory.model.loader as loader
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.data.parser import get_dataset_list
    from llamafactory.hparams import DataArguments, ModelArguments

    from resumable_stream.integrations.llamafactory.media import ProcessorLoader, media_settings
    from resumable_stream.integrations.llamafactory.processor import Formatting, LlamaFactoryProcessor

    saved, loader.AutoProcessor = loader.AutoProcessor, ProcessorLoader
    try:
        module = loader.load_tokenizer(ModelArguments(model_name_or_path=model))
    finally:
        loader.AutoProcessor = saved
    assert module["processor"] is not None
    data_args = DataArguments(template="qwen2_vl", dataset="mllm", dataset_dir=data, cutoff_len=512, streaming=True)
    template = get_template_and_fix_tokenizer(module["tokenizer"], data_args)
    attr = get_dataset_list(["mllm"], data)[0]
    fmt = Formatting(template=template, tokenizer=module["tokenizer"], data_args=data_args, stage="sft",
                     attrs={"mllm": attr}, processor=module["processor"],
                     media=media_settings(ours_section, data_args.media_dir))
    return LlamaFactoryProcessor(fmt), module["tokenizer"]


def _bad_rows(tmp_path, data: str) -> dict[str, tuple[dict, str]]:
    """name -> (a row with one bad image, what the error says)."""
    good = os.path.join(data, "pictures", "2.png")
    (tmp_path / "outside.png").write_bytes(open(good, "rb").read())
    os.symlink(str(tmp_path / "outside.png"), os.path.join(data, "link-out.png"))
    with open(os.path.join(data, "cut.png"), "wb") as f:
        f.write(open(good, "rb").read()[:50])
    with open(os.path.join(data, "not-an-image.png"), "w", encoding="utf-8") as f:
        f.write("hello")
    os.mkfifo(os.path.join(data, "fifo.png"))
    cases = {"missing": ("pictures/nope.png", "not found"), "cut": ("cut.png", "cannot be decoded"),
             "garbage": ("not-an-image.png", "cannot be decoded"), "dotdot": ("../outside.png", "leads out of"),
             "absolute": (str(tmp_path / "outside.png"), "is absolute"), "symlink": ("link-out.png", "leads out of"),
             "fifo": ("fifo.png", "not a regular file"), "url": ("http://127.0.0.1:9/x.png", "is a URL"),
             "count": (None, "3 <image> placeholder(s) in the messages but 2 image(s)")}
    rows = {}
    for name, (image, message) in cases.items():
        row = vl_rows(1)[0]
        if image is None:
            next(m for m in row["messages"] if m["role"] == "user")["content"] += " <image>"
        else:
            row["images"][0] = image
        rows[name] = (row, message)
    return rows


def test_bad_images_follow_bad_sample_and_never_leave_media_dir(vl_assets, tmp_path):
    """A missing, cut, non-image, escaping (``..``, absolute, symlink), FIFO or URL image, and a placeholder count
    that differs from the images: ``bad_sample: error`` names the sample, the dataset and why; ``skip`` skips
    the row (counted) and goes on; a good row reaches LLaMA-Factory's processor with its image's real path."""
    model, data = vl_assets
    data_copy = tmp_path / "data"
    data_copy.mkdir()
    shutil.copytree(os.path.join(data, "pictures"), data_copy / "pictures")
    with open(os.path.join(data, "dataset_info.json"), encoding="utf-8") as f:
        (data_copy / "dataset_info.json").write_text(f.read())
    rows = _bad_rows(tmp_path, str(data_copy))
    strict, tokenizer = _transform(model, str(data_copy), {})
    for name, (row, message) in rows.items():
        with pytest.raises(TransformError) as e:
            strict.feed(row, f"0:{name}")
        assert f"sample '0:{name}' of dataset 'mllm.json'" in str(e.value) and message in str(e.value), name
        assert "resumable_stream.bad_sample is 'error'" in str(e.value)
    assert strict.ready() == 0
    lenient, _ = _transform(model, str(data_copy), {"bad_sample": "skip"})
    for name, (row, _) in rows.items():
        lenient.feed(row, f"0:{name}")
    good = vl_rows(1)[0]
    lenient.feed(good, "0:good")
    stats = lenient.stats()
    assert (stats["skipped_image"], stats["skipped_mismatch"], stats["examples"]) == (len(rows) - 1, 1, 1)
    example = lenient.take()
    assert example["keys"] == ["0:good"]
    assert example["images"] == [os.path.realpath(data_copy / "pictures" / name) for name in ("0.png", "0.png")]
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # 32x32 pictures: 8-px patches merged 2x2, 4 image tokens each
    assert example["input_ids"].count(image_pad) == 8       # two 32x32 pictures


def test_image_bytes_rows_survive_a_state_round_trip(vl_assets):
    """An HF Image struct (``{"bytes", "path"}``, as parquet rows hold them) is handed to LLaMA-Factory as it is;
    an example not yet taken at a checkpoint keeps its bytes through ``state`` / ``load_state``."""
    model, data = vl_assets
    transform, _ = _transform(model, data, {})
    row = vl_rows(1)[0]
    png = open(os.path.join(data, "pictures", "0.png"), "rb").read()
    row["images"][0] = {"bytes": png, "path": None}
    transform.feed(row, "0:0")
    state = transform.state()
    again, _ = _transform(model, data, {})
    again.load_state(state)
    before, after = transform.take(), again.take()
    assert after == before and after["images"][0]["bytes"] == png


@pytest.mark.parametrize(("section", "message"), [
    ({"bad_sample": "maybe"}, "resumable_stream.bad_sample: got 'maybe'; allowed: one of error, skip"),
    ({"max_image_bytes": 0}, "resumable_stream.max_image_bytes: got 0"),
    ({"max_image_pixels": 10 ** 400}, "resumable_stream.max_image_pixels: got <an integer of 401 digits>"),
    ({"allow_absolute_image_paths": "yes"}, "resumable_stream.allow_absolute_image_paths: got 'yes'"),
])
def test_image_keys_of_the_section_are_checked_naming_them(section, message):
    from resumable_stream.integrations.llamafactory.settings import split

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        split({"stage": "sft", "resumable_stream": section})


@pytest.mark.parametrize(("stage", "val_size", "message"), [
    ("rm", None, "with a preference stage (dpo, kto, rm); not supported"),
    ("kto", None, "with a preference stage (dpo, kto, rm); not supported"),
    ("sft", 10, "with val_size 10; not supported"),
])
def test_a_multimodal_model_outside_sft_is_refused_naming_why(stage, val_size, message):
    from types import SimpleNamespace

    from resumable_stream.integrations.llamafactory.data import get_dataset

    model_args = SimpleNamespace(model_name_or_path="org/vl")
    data_args = SimpleNamespace(val_size=val_size)
    with pytest.raises(ConfigError, match=r"model_name_or_path: 'org/vl' loads with a multimodal processor") as e:
        get_dataset(None, {}, None, model_args, data_args, None, stage, None, processor=object())
    assert message in str(e.value)
