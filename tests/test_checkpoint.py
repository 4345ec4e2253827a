"""Checkpoints: exact roundtrip, keep-last-K, atomic saves, corrupt checkpoints, final export."""

import errno
import json
import logging
import os
import random
import stat
import tempfile

import numpy as np
import pytest
import torch

from posttrain.checkpoint import (
    RunRecord,
    atomic_dir,
    check_resume,
    claim_run_dir,
    find_latest_checkpoint,
    load_checkpoint,
    load_weights,
    resolve_resume,
    save_checkpoint,
    save_final,
)
from posttrain.checkpoint.io_errors import io_error
from posttrain.cli import main, os_error_line
from posttrain.config import ConfigError
from posttrain.config.sections import TrainerConfig
from posttrain.data.tokenizer import build_tokenizer
from posttrain.models import BuiltinLM
from posttrain.training.core import build_optimizer, build_scheduler, set_seed, train_step

VOCAB = 64


def tiny_lm(seed: int) -> BuiltinLM:
    torch.manual_seed(seed)
    return BuiltinLM.from_preset("tiny", vocab_size=VOCAB, num_hidden_layers=1)


def lm_loss(model, ids):
    logits = model(ids)  # (B, T, V)
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"
    )
    return ce, ids[:, 1:].numel(), {}


def trained(seed: int = 0, steps: int = 2):
    """A tiny model, its AdamW and cosine schedule after `steps` real steps."""
    model = tiny_lm(seed)
    cfg = TrainerConfig(learning_rate=1e-2, warmup_steps=1, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, total_steps=10)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        train_step(model, [ids], lm_loss, opt, sched, 1.0)
    return model, opt, sched


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def save(run_dir, step, model, opt, sched, tokenizer=None, keep=0, **kw):
    data_state = {"epoch": 1, "index": 8 * step}
    return save_checkpoint(run_dir, step, model, tokenizer, opt, sched, data_state, keep, **kw)


def test_roundtrip_restores_weights_optimizer_schedule_and_rng(tmp_path, tokenizer):
    model, opt, sched = trained(seed=0)
    path = save(
        tmp_path, 2, model, opt, sched, tokenizer, metrics={"loss": 1.5, "bad": float("nan")}
    )
    assert path == tmp_path / "checkpoints" / "step-2"
    readable = json.loads((path / "trainer_state.json").read_text())
    assert readable["step"] == 2 and readable["metrics"] == {"loss": 1.5, "bad": None}
    next_draws = (torch.rand(3), random.random(), np.random.rand())

    fresh, fresh_opt, fresh_sched = trained(seed=1, steps=0)  # other weights, empty state
    set_seed(123)
    info = load_checkpoint(path, fresh, fresh_opt, fresh_sched)

    assert info["step"] == 2 and info["data_state"] == {"epoch": 1, "index": 16}
    assert info["metrics"]["loss"] == 1.5
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, fresh.state_dict()[name]), name
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # still tied
    for p, q in zip(opt.param_groups[0]["params"], fresh_opt.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])
    assert fresh_sched.last_epoch == 2 and fresh_sched.get_last_lr() == sched.get_last_lr()
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(torch.rand(3), next_draws[0])
    assert random.random() == next_draws[1] and np.random.rand() == next_draws[2]
    assert (path / "tokenizer.json").exists() and (path / "COMPLETE").exists()


def test_keeps_the_newest_k(tmp_path):
    model, opt, sched = trained(steps=0)
    for step in (1, 2, 3, 4):
        save(tmp_path, step, model, opt, sched, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-3", "step-4"]
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-4"


def test_unfinished_saves_are_ignored_then_cleaned(tmp_path):
    model, opt, sched = trained(steps=0)
    save(tmp_path, 1, model, opt, sched)
    root = tmp_path / "checkpoints"
    crashed = root / ".tmp-step-9-abc123"  # a crash mid-save: never renamed
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"partial")
    assert find_latest_checkpoint(tmp_path) == root / "step-1"
    save(tmp_path, 2, model, opt, sched)
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"]


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: (p / "COMPLETE").unlink(), "no COMPLETE marker"),
        (lambda p: (p / "trainer_state.pt").unlink(), "trainer_state.pt is missing"),
        (lambda p: _truncate(p / "model.safetensors"), "truncated"),
    ],
)
def test_corrupt_newest_is_skipped_with_a_warning(tmp_path, caplog, damage, reason):
    model, opt, sched = trained(steps=0)
    save(tmp_path, 1, model, opt, sched)
    newest = save(tmp_path, 2, model, opt, sched)
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="posttrain.checkpoint"):
        assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-1"
    assert "step-2" in caplog.text and reason in caplog.text
    with pytest.raises(ValueError, match="incomplete"):
        load_checkpoint(newest, model)


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _flip(file, at=0.5):
    """Flip one byte of `file` (a damaged file of the same size): at fraction `at` of it, at
    byte `at` when it is an int (negative: from the end), or the byte after `at` when it is bytes."""
    data = bytearray(file.read_bytes())
    if isinstance(at, bytes):
        at = data.index(at) + len(at)
    data[at if isinstance(at, int) else int(len(data) * at)] ^= 0xFF
    file.write_bytes(bytes(data))


DAMAGED = {  # file: where a flipped byte lands (the safetensors header, a weight, the zip's directory, the JSON)
    "model.safetensors header": ("model.safetensors", 0.0),
    "model.safetensors weight": ("model.safetensors", 0.7),
    "trainer_state.pt zip": ("trainer_state.pt", -22),  # the zip's end-of-central-directory record
    "trainer_state.pt pickle": ("trainer_state.pt", b"\x80\x02"),  # its first opcode: UnpicklingError
    "trainer_state.json": ("trainer_state.json", 0.0),
}


@pytest.mark.parametrize("kind", DAMAGED)
def test_a_damaged_file_of_the_right_size_is_skipped_by_auto_and_named_by_path(tmp_path, caplog, kind):
    """Issue #31 item 4: a flipped byte crashed resume=auto (SafetensorError, an UnpicklingError
    advising weights_only=False, json's "Expecting value") or, in a weight, loaded silently."""
    name, at = DAMAGED[kind]
    model, opt, sched = trained(steps=0)
    older = save(tmp_path, 1, model, opt, sched)
    newest = save(tmp_path, 2, model, opt, sched)
    _flip(newest / name, at)
    with caplog.at_level(logging.WARNING, logger="posttrain.checkpoint"):
        assert resolve_resume(tmp_path, "auto") == older
    assert f"skipping checkpoint {newest}: {name} is damaged (CRC32" in caplog.text
    assert "trying the one before it" in caplog.text
    with pytest.raises(ValueError, match=f"trainer.resume={newest}: .* \\({name} is damaged") as err:
        resolve_resume(tmp_path, str(newest))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", DAMAGED)
def test_a_damaged_checkpoint_without_checksums_is_an_error_naming_the_file(tmp_path, kind):
    """A checkpoint sealed before COMPLETE recorded checksums still loads; when one of its files
    is damaged, loading it says which, in one line, never advising weights_only=False."""
    name, at = DAMAGED[kind]
    model, opt, sched = trained(steps=0)
    path = save(tmp_path, 1, model, opt, sched)
    manifest = json.loads((path / "COMPLETE").read_text())
    del manifest["crc32"]
    (path / "COMPLETE").write_text(json.dumps(manifest))
    assert resolve_resume(tmp_path, "auto") == path
    fresh, fresh_opt, fresh_sched = trained(seed=1, steps=0)
    load_checkpoint(path, fresh, fresh_opt, fresh_sched)  # old checkpoints stay loadable
    _flip(path / name, at)
    if kind == "model.safetensors weight":  # no checksum to catch it: the weight is just wrong
        return
    with pytest.raises(ValueError, match=f"checkpoint file {path / name} is damaged and cannot be read") as err:
        load_checkpoint(path, fresh, fresh_opt, fresh_sched)
    assert "weights_only" not in str(err.value) and "\n" not in str(err.value)


def test_resolve_resume(tmp_path):
    assert resolve_resume(tmp_path, "auto") is None  # fresh run
    model, opt, sched = trained(steps=0)
    path = save(tmp_path, 3, model, opt, sched)
    assert resolve_resume(tmp_path, "never") is None
    assert resolve_resume(tmp_path, "auto") == path
    assert resolve_resume(tmp_path / "elsewhere", str(path)) == path
    assert resolve_resume(tmp_path / "elsewhere", str(tmp_path)) == path  # a run directory
    with pytest.raises(FileNotFoundError, match="nope/step-1"):
        resolve_resume(tmp_path, str(tmp_path / "nope" / "step-1"))
    (path / "COMPLETE").unlink()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_resume(tmp_path, str(path))


def test_the_run_record_is_checked_key_by_key_and_tolerates_another_version(tmp_path):
    model, opt, sched = trained(steps=0)
    config = {"model": {"init": "tiny", "device": "cpu"}, "trainer": {"max_steps": 4, "output_dir": "a"}}
    record = RunRecord.of("sft", config, model)
    assert record.settings == {"model.device": "cpu", "trainer.max_steps": 4}  # output_dir is not recorded
    path = save(tmp_path, 3, model, opt, sched, run=record)
    assert RunRecord.read(path) == record

    moved = {"model": {"init": "tiny", "device": "cuda"}, "trainer": {"max_steps": 9, "output_dir": "b"}}
    assert check_resume(path, RunRecord.of("sft", moved, model), "auto", 9) == [
        'model.device: "cpu" → "cuda"', "trainer.max_steps: 4 → 9"]
    # A setting the checkpoint's posttrain did not have is listed, not refused.
    newer = {**config, "data": {"new_option": 1}}
    assert check_resume(path, RunRecord.of("sft", newer, model), "auto", 4) == ["data.new_option: (not recorded) → 1"]
    with pytest.raises(ConfigError, match=r'model.init: "tiny" → "small".*new trainer.output_dir'):
        check_resume(path, RunRecord.of("sft", {**config, "model": {"init": "small"}}, model), "auto", 4)
    with pytest.raises(ConfigError, match="belongs to a `posttrain sft` run, and this is `posttrain dpo`"):
        check_resume(path, RunRecord.of("dpo", config, model), "auto", 4)
    wider = BuiltinLM.from_preset("tiny", vocab_size=VOCAB + 1, num_hidden_layers=1)
    with pytest.raises(ConfigError, match=r"\(built model\): \"BuiltinLM, .* parameters"):
        check_resume(path, RunRecord.of("sft", config, wider), "auto", 4)
    with pytest.raises(ConfigError, match="already at step 3, past the end"):
        check_resume(path, record, "auto", 2)


def test_a_new_run_claims_only_an_unused_folder_and_overwrite_removes_only_run_outputs(tmp_path):
    model, opt, sched = trained(steps=0)
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    ckpt = save(run, 1, model, opt, sched)
    claim_run_dir(run, ckpt, "auto", overwrite=False)  # continuing its own run
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints/\)"):
        claim_run_dir(run, None, "never", overwrite=False)
    claim_run_dir(elsewhere, ckpt, str(ckpt), overwrite=False)  # a checkpoint from elsewhere, an unused folder
    with pytest.raises(ConfigError, match="already holds a run"):
        claim_run_dir(run, save(elsewhere, 1, model, opt, sched), str(elsewhere), overwrite=False)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "notes.txt").write_text("mine")
    claim_run_dir(run, None, "never", overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    claim_run_dir(run, None, "never", overwrite=False)  # nothing of a run left


def test_same_step_saved_twice_is_replaced(tmp_path):
    model, opt, sched = trained(steps=0)
    save(tmp_path, 5, model, opt, sched, metrics={"v": 1})
    path = save(tmp_path, 5, model, opt, sched, metrics={"v": 2})
    assert json.loads((path / "trainer_state.json").read_text())["metrics"] == {"v": 2}
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-5"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_final_and_checkpoints_get_mkdir_permissions_not_mkdtemp_ones(tmp_path, tokenizer, umask):
    # mkdtemp makes 0o700 folders; final/ and step-N/ are read by other programs and users.
    model, opt, sched = trained(steps=0)
    old = os.umask(umask)
    try:
        step = save(tmp_path, 1, model, opt, sched, tokenizer)
        final = save_final(tmp_path, model, tokenizer)
    finally:
        os.umask(old)
    for path in (step, final):
        assert stat.S_IMODE(path.stat().st_mode) == 0o777 & ~umask != 0o700, path
        # Every file alike: safetensors writes model.safetensors 0o600, open() the rest 0o666 & ~umask.
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in path.rglob("*") if f.is_file()}
        assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes
    assert os.umask(old) == old  # the umask is as it was


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to fill the disk")
def test_a_full_disk_during_a_save_is_one_oserror_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    model, opt, sched = trained(steps=0)
    first = save(tmp_path, 1, model, opt, sched)
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp_on_a_full_disk(*args, **kwargs):  # trainer_state.pt lands on a full device
        folder = real_mkdtemp(*args, **kwargs)
        os.symlink("/dev/full", os.path.join(folder, "trainer_state.pt"))
        return folder

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_on_a_full_disk)
    with pytest.raises(OSError) as caught:
        save(tmp_path, 2, model, opt, sched)
    # Before: RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos ...').
    assert caught.value.errno == errno.ENOSPC
    assert str(caught.value) == f"[Errno 28] cannot save {tmp_path}/checkpoints/step-2: No space left on device"
    assert os_error_line(caught.value) == f"cannot save {tmp_path}/checkpoints/step-2: No space left on device"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-1"]  # no half save left
    assert find_latest_checkpoint(tmp_path) == first


def test_io_error_reads_the_cause_out_of_each_writers_report():
    from safetensors import SafetensorError

    full = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })')
    assert io_error(full).errno == errno.ENOSPC and io_error(full).strerror == os.strerror(errno.ENOSPC)
    assert io_error(OSError(errno.EROFS, "Read-only file system")).errno == errno.EROFS
    assert io_error(SafetensorError("Error while serializing: header too large")) is None
    assert io_error(FileNotFoundError(errno.ENOENT, "gone")) is None  # a missing input is not a failed write
    assert io_error(RuntimeError("Os { code: 28")) is None
    try:  # torch.save into a Python file on a full disk: its RuntimeError hides the file's OSError
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 12619072 vs 12618960")  # noqa: B904 (as torch does)
    except RuntimeError as err:
        assert io_error(err).errno == errno.ENOSPC


@pytest.mark.parametrize("output, cause", [("afile/run", "Not a directory"),
                                           ("afile", "is a file, not a folder: name a folder in trainer.output_dir")])
def test_an_output_folder_under_or_at_a_regular_file_is_one_line_naming_it(tmp_path, capsys, output, cause):
    (tmp_path / "afile").write_text("not a folder")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(8)))
    code = main(["sft", "model.init=tiny", f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path}/{output}",
                 "trainer.max_steps=1", "trainer.report_to=[]", "trainer.progress=false", "data.train_batch_size=4",
                 "trainer.micro_batch_size=4"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"posttrain sft: error: {tmp_path}/{output}: {cause}"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fsynced files through /proc")
def test_atomic_dir_fsyncs_then_replaces_and_keeps_the_old_folder_on_error(tmp_path, monkeypatch):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("one")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_dir(out) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("boom")
    assert (out / "a.txt").read_text() == "one" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert synced == []  # nothing published, nothing synced
    with atomic_dir(out) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("two")
    assert [p.name for p in out.rglob("*")] == ["sub", "b.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # The file, both folders (under their temporary name) and, after the rename, the parent.
    assert synced[0].endswith("/sub/b.txt") and synced[-1] == str(tmp_path) and len(synced) == 4


def test_final_loads_in_plain_transformers(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, _, _ = trained(steps=1)
    final = save_final(tmp_path, model, tokenizer)
    assert final == tmp_path / "final"
    hf = AutoModelForCausalLM.from_pretrained(final)
    ids = AutoTokenizer.from_pretrained(final)("hello", return_tensors="pt")["input_ids"] % VOCAB
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=1e-5)
    assert save_final(tmp_path, model, tokenizer) == final  # replaces the old export


@pytest.mark.parametrize("tied", [True, False])
def test_weights_of_hf_models_roundtrip(tmp_path, tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    source = LlamaForCausalLM(config)
    source.save_pretrained(tmp_path)
    torch.manual_seed(1)
    target = LlamaForCausalLM(config)
    load_weights(tmp_path, target)
    for name, tensor in source.state_dict().items():
        assert torch.equal(tensor, target.state_dict()[name]), name


def test_mismatched_weights_are_an_error(tmp_path):
    tiny_lm(0).save_pretrained(tmp_path)
    other = BuiltinLM.from_preset("tiny", vocab_size=VOCAB, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"missing \['model.layers.1"):
        load_weights(tmp_path, other)


@pytest.mark.slow
def test_lora_adapter_roundtrip(tmp_path):
    from peft import LoraConfig, get_peft_model

    def lora_model(seed):
        torch.manual_seed(0)
        base = tiny_lm(0)
        torch.manual_seed(seed)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return get_peft_model(base, config)

    source, target = lora_model(1), lora_model(2)
    opt = torch.optim.AdamW([p for p in source.parameters() if p.requires_grad])
    path = save_checkpoint(tmp_path, 1, source, None, opt, None, {}, keep=1)
    assert (path / "adapter_model.safetensors").exists()
    load_checkpoint(path, target)
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name


def _in_a_mount_namespace() -> bool:
    """Whether `unshare -Urm` works here (it lets a test mount a tiny or read-only tmpfs)."""
    import shutil
    import subprocess

    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-Urm", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _in_a_mount_namespace(), reason="needs unprivileged user and mount namespaces")
def test_a_run_on_a_full_then_a_read_only_disk_stops_with_one_line(tmp_path):
    # A real full disk: safetensors reports it as SafetensorError(...Os { code: 28 ...}), torch.save
    # as RuntimeError('[enforce fail at inline_container.cc:672]') (the traceback).
    import subprocess
    import sys

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(8)))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run = mnt / "run"
    cli = (f"{sys.executable} -m posttrain.cli sft model.init=tiny data.train_files=[{data}] trainer.output_dir={run} "
           "trainer.max_steps=3 trainer.save_steps=1 trainer.report_to=[] trainer.progress=false "
           "data.train_batch_size=4 trainer.micro_batch_size=4")
    # One checkpoint (~22 MB: weights, AdamW's two moments) fits in 40 MB, a second does not.
    script = (f"mount -t tmpfs -o size=40m tmpfs {mnt} && {cli} 2>{tmp_path}/full.err; echo $? > {tmp_path}/full.rc; "
              f"cp -r {run} {tmp_path}/kept; mount -o remount,ro {mnt} && {cli} trainer.resume=auto "
              f"2>{tmp_path}/ro.err; echo $? > {tmp_path}/ro.rc")
    subprocess.run(["unshare", "-Urm", "sh", "-c", script], check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    full = (tmp_path / "full.err").read_text()
    assert (tmp_path / "full.rc").read_text().strip() == "1" and "Traceback" not in full
    assert full.strip().splitlines()[-1] == f"posttrain sft: error: cannot save {run}/checkpoints/step-2: No space left on device"
    kept = tmp_path / "kept"
    assert sorted(p.name for p in (kept / "checkpoints").iterdir()) == ["step-1"]
    assert find_latest_checkpoint(kept) == kept / "checkpoints" / "step-1"  # sealed, checksums intact
    read_only = (tmp_path / "ro.err").read_text()
    assert (tmp_path / "ro.rc").read_text().strip() == "1" and "Traceback" not in read_only
    assert "Read-only file system" in read_only.strip().splitlines()[-1] and str(run) in read_only.strip().splitlines()[-1]
