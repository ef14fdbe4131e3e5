"""The LLaMA-Factory trainers' checkpoint loaders (renamed weights, a LoRA reward model) share one wrapper:
each loader is tried once before the Trainer's own, whatever the number of times a class is patched."""

from types import SimpleNamespace

from resumable_stream.integrations.llamafactory.weights import patch_checkpoint_loader


def _trainer_class(calls):
    class Trainer:
        accelerator = SimpleNamespace(unwrap_model=lambda m: ("unwrapped", m))
        model = "model"

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            calls.append(("trainer's own", resume_from_checkpoint, model))

    return Trainer


def test_each_loader_is_tried_once_then_the_trainers_own():
    calls = []
    trainer = _trainer_class(calls)

    def renamed(model, checkpoint):
        calls.append(("renamed", model, checkpoint))
        return checkpoint == "ckpt-renamed"

    def value_head(model, checkpoint):
        calls.append(("value head", model, checkpoint))
        return checkpoint == "ckpt-head"

    for load in (renamed, renamed, value_head, renamed, value_head):
        patch_checkpoint_loader(trainer, load)
    trainer()._load_from_checkpoint("ckpt-other")
    assert calls == [("value head", ("unwrapped", "model"), "ckpt-other"),
                     ("renamed", ("unwrapped", "model"), "ckpt-other"),
                     ("trainer's own", "ckpt-other", None)]
    calls.clear()
    trainer()._load_from_checkpoint("ckpt-head", model="m2")
    assert calls == [("value head", ("unwrapped", "m2"), "ckpt-head")]
    calls.clear()
    trainer()._load_from_checkpoint("ckpt-renamed")
    assert [c[0] for c in calls] == ["value head", "renamed"]
