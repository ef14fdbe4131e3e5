"""`resumable-stream llamafactory train` against the real llamafactory 0.9.5 (issue 21): the yaml of
llamafactory-cli, LLaMA-Factory's own formatting (per-step losses equal to llamafactory-cli's), exact resume
after SIGKILL (after a checkpoint and in the middle of a save), a finished run left intact, refusals."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest
from lf_helpers import ENV, assert_losses_equal, consumed, llamafactory_cli, losses, ours, write_yaml
from training_helpers import complete_checkpoints, count_lines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
HERE = os.path.dirname(os.path.abspath(__file__))

# llamafactory-cli and ours on the same yaml, shuffling off on both sides (buffer_size 1, one DataLoader
# worker: llamafactory-cli then reads its one shard in file order)
SAME_AS_CLI = {
    "sft-alpaca-full": {},
    "sft-sharegpt-lora-system-mask_history": {"dataset": "sharegpt", "finetuning_type": "lora", "lora_rank": 4,
                                              "lora_target": "all", "default_system": "You are terse.",
                                              "mask_history": True},
    "sft-alpaca-packing-train_on_prompt": {"packing": True, "train_on_prompt": True, "cutoff_len": 128},
    "sft-sharegpt-neat_packing": {"dataset": "sharegpt", "neat_packing": True, "cutoff_len": 128},
    "pt": {"stage": "pt", "dataset": "pt", "cutoff_len": 64},
    # issue 38: past the end of the data (other.jsonl, 80 rows: pt reaches its end at step 13), and two datasets
    # concatenated (llamafactory-cli reads other.jsonl first with seed 42); neat packing in chunks of 1000
    # rows past the end: test_llamafactory_epochs.py
    "pt-across-the-end-of-the-data": {"stage": "pt", "dataset": "other", "cutoff_len": 32},
    "sft-concat-two-datasets-packing": {"dataset": "alpaca,other", "packing": True, "cutoff_len": 128},
    # few.jsonl 14 rows, fewer.jsonl 9: the 40 rows of 20 steps cross two ends of mixture epochs (14, 17 rows)
    "sft-interleave_under-probs": {"dataset": "few,fewer", "mix_strategy": "interleave_under",
                                   "interleave_probs": "0.5,0.5"},
}


@pytest.mark.parametrize("case", sorted(SAME_AS_CLI))
def test_per_step_losses_equal_those_of_llamafactory_cli(assets, procs, tmp_path, case):
    model, data = assets
    keys = SAME_AS_CLI[case]
    cli_yaml, cli_out = write_yaml(str(tmp_path), "cli", model, data, streaming=True, **keys)
    our_yaml, our_out = write_yaml(str(tmp_path), "ours", model, data, **keys)   # streaming implied
    procs.start(cli_yaml, "cli", env=ENV, command=llamafactory_cli(cli_yaml)).wait_ok(600)
    procs.start(our_yaml, "ours", env=ENV, command=ours(our_yaml)).wait_ok(600)
    reference, ours_losses = losses(cli_out), losses(our_out)
    assert len(reference) == 20
    assert_losses_equal(reference, ours_losses, 1e-6, f"[{case}]")
    # LLaMA-Factory's own workflow ran: its callbacks' log, the final save, its metrics
    assert count_lines(os.path.join(our_out, "trainer_log.jsonl")) >= 20
    saved = "adapter_model.safetensors" if keys.get("finetuning_type") == "lora" else "model.safetensors"
    assert os.path.isfile(os.path.join(our_out, saved)) and os.path.isfile(os.path.join(our_out, "all_results.json"))
    assert os.path.isdir(os.path.join(our_out, "checkpoint-20", "stream_state"))


def _tree_digest(out: str) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), out): hashlib.blake2b(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, fs in os.walk(out) for f in fs}


def test_a_finished_run_started_again_trains_nothing_and_changes_nothing(assets, procs, tmp_path):
    model, data = assets
    config, out = write_yaml(str(tmp_path), "run", model, data, max_steps=12, save_steps=6)
    procs.start(config, "first", env=ENV, command=ours(config)).wait_ok(600)
    before = _tree_digest(out)
    again = procs.start(config, "again", env=ENV, command=ours(config)).wait_ok(600)
    assert "already finished at step 12" in again.stderr
    assert _tree_digest(out) == before


@pytest.mark.parametrize("where", ["after-a-checkpoint", "in-the-middle-of-a-save"])
def test_a_sigkilled_run_started_again_continues_exactly(assets, procs, tmp_path, where):
    model, data = assets
    keys = {"max_steps": 40, "save_steps": 10, "buffer_size": 64, "dataset": "alpaca,sharegpt",
            "mix_strategy": "interleave_under", "interleave_probs": "0.7,0.3"}
    ref_yaml, ref_out = write_yaml(str(tmp_path), "reference", model, data, consumed_log=True, **keys)
    procs.start(ref_yaml, "reference", env=ENV, command=ours(ref_yaml)).wait_ok(600)
    config, out = write_yaml(str(tmp_path), "killed", model, data, consumed_log=True, **keys)
    log = os.path.join(out, "trainer_log.jsonl")
    if where == "after-a-checkpoint":
        run = procs.start(config, "killed", env=ENV, command=ours(config))
        run.wait_until(lambda: 20 in complete_checkpoints(out) and count_lines(log) >= 24, "checkpoint-20 + 4 steps")
        expected_resume = 20
    else:   # rank 0 waits before the manifest that completes a checkpoint: the kill lands in the save
        run = procs.start(config, "killed", env=ENV, command=[sys.executable, os.path.join(HERE, "slow_save.py"),
                                                              config])
        state = os.path.join(out, "checkpoint-20", "stream_state")
        run.wait_until(lambda: os.path.isfile(os.path.join(state, "rank-00000.safetensors")), "checkpoint-20's save")
        expected_resume = 10
    run.kill()
    assert count_lines(log) < 41
    restart = procs.start(config, "restart", env=ENV, command=ours(config)).wait_ok(600)
    printed = restart.stdout + restart.stderr
    assert f"Resuming training from {os.path.join(out, f'checkpoint-{expected_resume}')}." in printed
    assert "Will skip the first" not in printed                   # no batch is replayed
    assert not os.path.exists(os.path.join(out, "checkpoint-20")) or 20 in complete_checkpoints(out)
    assert_losses_equal(losses(ref_out), losses(out), 0.0, f"[killed {where}]")
    assert consumed(ref_out) == consumed(out)
    steps = [int(line.split('"current_steps": ')[1].split(",")[0]) for line in open(log, encoding="utf-8")
             if '"loss"' in line]
    assert steps == list(range(1, 41))                            # trainer_log.jsonl: every step once


def test_another_template_on_resume_is_a_mismatch(assets, procs, tmp_path):
    model, data = assets
    config, out = write_yaml(str(tmp_path), "run", model, data, max_steps=10, save_steps=10)
    procs.start(config, "first", env=ENV, command=ours(config)).wait_ok(600)
    other = procs.start(config, "other", env=ENV, command=ours(config, "max_steps=20", "default_system=Other."))
    assert other.wait(600) == 2, other.describe()
    assert "the saved stream state was written for different data or settings" in other.stderr
    assert "transform.template: saved" in other.stderr and "transform.data.default_system: saved None" in other.stderr


@pytest.mark.parametrize(("keys", "message"), [
    ({"max_samples": 100}, "max_samples: got 100"),
    ({"streaming": False}, "streaming: got False"),
    ({"max_steps": None}, "max_steps: got None"),
    ({"dataset": "alpaca,other", "mix_strategy": "interleave_once"}, "mix_strategy: got 'interleave_once'"),
    ({"dataset": "alpaca,sharegpt"}, "mix_strategy: got 'concat'"),
    ({"resumable_stream": {"bogus": 1}}, "resumable_stream.bogus: unknown key"),
    ({"resumable_stream": {"buffer_size": 0}}, "resumable_stream.buffer_size: got 0"),
])
def test_what_cannot_be_honoured_exactly_is_refused_naming_the_key(assets, procs, tmp_path, keys, message):
    model, data = assets
    config, _ = write_yaml(str(tmp_path), "refused", model, data, **keys)
    run = procs.start(config, "refused", env=ENV, command=ours(config))
    assert run.wait(300) == 2, run.describe()
    assert message in run.stderr, run.describe()


def test_hub_and_directory_datasets_of_dataset_info_are_streamed_and_resume_exactly(assets, procs, tmp_path):
    """An ``hf_hub_url`` entry (a dataset repo on the loopback Hub, its ``folder`` as data_dir) and a
    ``file_name`` directory of jsonl files, mixed; sharegpt with its own ``tags``. Killed after a checkpoint and
    started again, the run continues exactly."""
    import json
    import shutil

    from hub_server import HubServer, hub_env

    model, data = assets
    repo = tmp_path / "repo"
    (repo / "train").mkdir(parents=True)
    shutil.copy(os.path.join(data, "alpaca.jsonl"), repo / "train" / "part-0.jsonl")
    (repo / "README.md").write_text("tiny\n")
    local = tmp_path / "data"
    (local / "chats").mkdir(parents=True)
    with open(os.path.join(data, "sharegpt.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    for part in range(3):     # renamed roles and keys: the entry's tags say which is which
        with open(local / "chats" / f"chats-{part}.jsonl", "w", encoding="utf-8") as f:
            for row in rows[part::3]:
                turns = [{"speaker": {"human": "user", "gpt": "bot", "system": "sys"}[t["from"]], "text": t["value"]}
                         for t in row["conversations"]]
                f.write(json.dumps({"dialog": turns}) + "\n")
    (local / "dataset_info.json").write_text(json.dumps({
        "hub_alpaca": {"hf_hub_url": "org/tiny-alpaca", "folder": "train"},
        "chats": {"file_name": "chats", "formatting": "sharegpt", "columns": {"messages": "dialog"},
                  "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "user",
                           "assistant_tag": "bot", "system_tag": "sys"}}}))
    keys = {"dataset": "hub_alpaca,chats", "mix_strategy": "interleave_over", "interleave_probs": "0.6,0.4",
            "max_steps": 24, "save_steps": 10, "buffer_size": 16}
    with HubServer(tmp_path / "hub-store") as hub:
        hub.commit("org/tiny-alpaca", directory=repo, message="data")
        env = {**ENV, **hub_env(hub, tmp_path / "hf-home")}
        ref, ref_out = write_yaml(str(tmp_path), "reference", model, str(local), consumed_log=True, **keys)
        procs.start(ref, "reference", env=env, command=ours(ref)).wait_ok(600)
        config, out = write_yaml(str(tmp_path), "killed", model, str(local), consumed_log=True, **keys)
        run = procs.start(config, "killed", env=env, command=ours(config))
        log = os.path.join(out, "trainer_log.jsonl")
        run.wait_until(lambda: 10 in complete_checkpoints(out) and count_lines(log) >= 13, "checkpoint-10")
        run.kill()
        procs.start(config, "restart", env=env, command=ours(config)).wait_ok(600)
        assert any("/resolve/" in r.path for r in hub.requests)          # the rows did come from the Hub
    assert_losses_equal(losses(ref_out), losses(out), 0.0, "[hub + directory datasets]")
    samples = [k for step in consumed(out).values() for k in step]
    assert samples == [k for step in consumed(ref_out).values() for k in step]
    assert {k.split("/", 1)[0] for k in samples} == {"hub_alpaca", "chats"}


def test_eval_dataset_is_evaluated_by_llamafactory_during_and_after_training(assets, procs, tmp_path):
    """``eval_dataset`` stays LLaMA-Factory's own dataset: evaluated every eval_steps and at the end (do_eval),
    with the same losses as llamafactory-cli (training data and evaluation data both equal)."""
    import json

    model, data = assets
    keys = {"eval_dataset": "other", "do_eval": True, "eval_strategy": "steps", "eval_steps": 10,
            "per_device_eval_batch_size": 4}
    cli_yaml, cli_out = write_yaml(str(tmp_path), "cli", model, data, streaming=True, **keys)
    our_yaml, our_out = write_yaml(str(tmp_path), "ours", model, data, **keys)
    procs.start(cli_yaml, "cli", env=ENV, command=llamafactory_cli(cli_yaml)).wait_ok(600)
    procs.start(our_yaml, "ours", env=ENV, command=ours(our_yaml)).wait_ok(600)

    def evals(out):
        with open(os.path.join(out, "trainer_state.json"), encoding="utf-8") as f:
            return {h["step"]: h["eval_loss"] for h in json.load(f)["log_history"] if "eval_loss" in h}

    assert sorted(evals(our_out)) == [10, 20]
    assert_losses_equal(evals(cli_out), evals(our_out), 1e-6, "[eval_loss]")
    assert_losses_equal(losses(cli_out), losses(our_out), 1e-6, "[train loss with evaluation]")
    with open(os.path.join(our_out, "all_results.json"), encoding="utf-8") as f:
        assert "eval_loss" in json.load(f)


def test_index_path_with_several_datasets_is_a_directory_of_one_index_per_source(assets, tmp_path):
    """A dataset index describes one dataset: with ``dataset: a,b`` interleaved, ``resumable_stream.index_path``
    names the directory `resumable-stream index MIX.yaml -o DIR` writes (one ``<label>.json`` per source)."""
    from types import SimpleNamespace

    from llamafactory.hparams import DataArguments

    from resumable_stream.config.stream_config import StreamConfig
    from resumable_stream.integrations.llamafactory.data import stream_section

    _, data = assets
    args = DataArguments(dataset="alpaca,sharegpt", dataset_dir=data, mix_strategy="interleave_under",
                         interleave_probs="0.7,0.3")
    index_dir = str(tmp_path / "indexes")
    section, _ = stream_section(args, SimpleNamespace(seed=7), {"index_path": index_dir, "verify_files": False})
    assert "index_path" not in section
    assert [s["index_path"] for s in section["sources"]] == [os.path.join(index_dir, "alpaca.json"),
                                                            os.path.join(index_dir, "sharegpt.json")]
    cfg = StreamConfig.from_dict(section, extra_keys=())
    assert [s.index_path for s in cfg.sources] == [os.path.join(index_dir, "alpaca.json"),
                                                  os.path.join(index_dir, "sharegpt.json")]


def test_interleave_probs_change_on_resume_only_with_mixture_change_allow(assets, procs, tmp_path):
    """10 steps at 0.9 / 0.1, resumed for 10 more at 0.1 / 0.9: refused without resumable_stream.mixture_change,
    applied from step 11 with it; the first 10 steps and each dataset's cursor are kept."""
    import json

    model, data = assets
    keys = {"max_steps": 10, "save_steps": 10, "buffer_size": 64, "dataset": "alpaca,sharegpt",
            "mix_strategy": "interleave_under", "interleave_probs": "0.9,0.1"}
    config, out = write_yaml(str(tmp_path), "run", model, data, consumed_log=True, **keys)
    procs.start(config, "first", env=ENV, command=ours(config)).wait_ok(600)
    before = consumed(out)
    changed = ("max_steps=20", "interleave_probs=0.1,0.9")
    refused = procs.start(config, "refused", env=ENV, command=ours(config, *changed))
    assert refused.wait(600) == 2, refused.describe()
    assert "sources.alpaca.weight: saved 0.9, now 0.1" in refused.stderr
    assert "set data.mixture_change: allow" in refused.stderr
    procs.start(config, "allowed", env=ENV,
                command=ours(config, *changed, "resumable_stream.mixture_change=allow")).wait_ok(600)
    after = consumed(out)
    assert {s: after[s] for s in before} == before and sorted(after) == list(range(1, 21))
    keys_of = [[k for s in steps for k in after[s]] for steps in (range(1, 11), range(11, 21))]
    share = [sum(k.startswith("sharegpt/") for k in ks) / len(ks) for ks in keys_of]
    assert share[0] < 0.35 and share[1] > 0.65, share
    every = keys_of[0] + keys_of[1]
    assert len(every) == len(set(every))           # nothing a dataset gave is given again
    with open(os.path.join(out, "checkpoint-20", "stream_state", "fingerprint.json"), encoding="utf-8") as f:
        history = json.load(f)["mixture"]["history"]
    assert [h["from"] for h in history] == ["config", "resume"]
    assert history[1]["weights"] == {"alpaca": 0.1, "sharegpt": 0.9}
