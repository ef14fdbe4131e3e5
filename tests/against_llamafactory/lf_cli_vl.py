"""``llamafactory-cli train CONFIG`` for a Qwen2-VL model in a venv without torchvision.

transformers 5 builds Qwen2-VL's video processor with torchvision only, so ``AutoProcessor`` fails there and
LLaMA-Factory's ``load_tokenizer`` drops the processor (then its mm_plugin refuses the first image). This runs
llamafactory-cli's own ``main`` with one change: its loader's ``AutoProcessor`` builds ``Qwen2VLProcessor``
without the video processor (the tokenizer and the PIL image processor are loaded as AutoProcessor loads
them). Written apart from resumable_stream's own fallback, so that the reference does not run the code under test."""

import sys

import llamafactory.model.loader as loader
from llamafactory.cli import main
from transformers import Qwen2VLProcessor


class Qwen2VLImagesProcessor(Qwen2VLProcessor):      # LLaMA-Factory keeps a processor named *Processor*
    @classmethod
    def get_attributes(cls):
        return [a for a in super().get_attributes() if "video" not in a]


class ImagesOnly:
    @staticmethod
    def from_pretrained(name, **kwargs):
        return Qwen2VLImagesProcessor.from_pretrained(name, **kwargs)


if __name__ == "__main__":
    loader.AutoProcessor = ImagesOnly
    sys.argv = ["llamafactory-cli", *sys.argv[1:]]
    main()
