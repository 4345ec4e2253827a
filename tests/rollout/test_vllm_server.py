"""Server mode (`rollout.vllm_mode=server`): `posttrain vllm-serve` and its client engine.

Without vLLM only the config, the client's refusals and the absent server are checked. The
tests marked `vllm` (`make test-vllm`, vLLM's CPU build) start the server as a subprocess on
127.0.0.1 (port 0: it prints the one it got) in a session of its own, and end it and its
children (`os.killpg`) whatever the test's outcome.
"""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import posttrain
from posttrain.algos import token_logprobs
from posttrain.config import ConfigError, build_config
from posttrain.config.rl import GRPOConfig
from posttrain.data.tasks import make_task
from posttrain.models import BuiltinLM
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.base import encode_prompts
from posttrain.rollout.native import NativeEngine
from posttrain.rollout.vllm_server import ServerClient, start_hint

from .conftest import PROMPTS, randomized
from .test_rollout_vllm import (
    TOOL_DEMO,
    TOOL_LIMITS,
    TOOL_ROWS,
    WIDE_HEADS,
    check_tool_episodes,
    teach_tool_episode,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def vllm_test(fn):
    """A test on vLLM's CPU build (`make test-vllm` runs `-m vllm`); skipped without vLLM."""
    return pytest.mark.vllm(pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM (make test-vllm: its CPU build)")(fn))

SRC = Path(posttrain.__file__).resolve().parents[1]
SHAPE = WIDE_HEADS  # head_dim 32: vLLM-CPU's least
LOGPROB_TOL = 1e-4  # fp32 server vs the fp32 policy's teacher-forced forward (measured: 6e-6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- without vLLM


def test_an_absent_server_is_one_line_naming_the_url_and_how_to_start_it(tok):
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        make_engine("vllm", randomized(**SHAPE), tok, server_url=url, timeout_s=0.5)
    message = str(err.value)
    assert time.monotonic() - start < 2 and "\n" not in message
    assert message.startswith(f"rollout.server_url={url}: no vLLM server answered there within "
                              "rollout.server_timeout_s=0.5 s (")
    assert f"`posttrain vllm-serve --model PATH --port {url.rsplit(':', 1)[1]} " in message
    assert message.endswith("or set rollout.vllm_mode=colocate")


def test_a_run_with_no_server_stops_before_its_model_loads():
    """The engine checks run before any model is built (`rl_build.check_engine_fits`, reading
    config.json at most): model.path need not even exist yet."""
    from posttrain.trainers.rl_build import check_engine_fits

    url = f"http://127.0.0.1:{free_port()}"
    cfg = build_config(GRPOConfig, None, ["model.path=/no/model/here", "rollout.engine=vllm", "rollout.vllm_mode=server",
                                          f"rollout.server_url={url}", "rollout.server_timeout_s=0.2"])
    with pytest.raises(ConfigError, match=f"^rollout.server_url={url}: no vLLM server answered there"):
        check_engine_fits(cfg, None)


def test_server_mode_keys_their_trl_names_and_what_is_refused():
    cfg = build_config(GRPOConfig, None, ["rollout.engine=vllm", "rollout.vllm_mode=server",
                                          "rollout.server_url=http://10.0.0.2:8001", "rollout.sync_bucket_mb=64"])
    assert (cfg.rollout.vllm_mode, cfg.rollout.server_url, cfg.rollout.sync_bucket_mb) == ("server", "http://10.0.0.2:8001", 64)
    with pytest.raises(ConfigError, match="Did you mean rollout.vllm_mode=server"):
        build_config(GRPOConfig, None, ["vllm_mode=server"])
    with pytest.raises(ConfigError, match="Did you mean rollout.server_url=http://h:1"):
        build_config(GRPOConfig, None, ["vllm_server_base_url=http://h:1"])
    with pytest.raises(ConfigError, match="vllm_server_port has no key of its own here; set the whole URL"):
        build_config(GRPOConfig, None, ["vllm_server_port=8001"])
    with pytest.raises(ConfigError, match="rollout.vllm_mode: server mode samples from a vLLM server: set "
                                          "rollout.engine=vllm too"):
        build_config(GRPOConfig, None, ["rollout.vllm_mode=server"])
    with pytest.raises(ConfigError, match="rollout.vllm_mode: server mode pushes the weights from the trainer's"):
        build_config(GRPOConfig, None, ["rollout.engine=vllm", "rollout.vllm_mode=server", "trainer.backend=ray",
                                        "placement.gpus_per_worker=1"])
    assert start_hint("http://10.0.0.2:8001") == ("posttrain vllm-serve --model PATH --host 10.0.0.2 --port 8001 "
                                                   "(PATH: the policy's checkpoint, model.path)")


# ---------------------------------------------------------------- a server on vLLM's CPU build


def tiny_folder(path: Path, tok) -> Path:
    model = randomized(**SHAPE)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class Server:
    """`posttrain vllm-serve` in a subprocess of its own session; `stop()` ends it and its children."""

    def __init__(self, folder: Path, log: Path, timeout_s: float = 300):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # --kv-cache-gb sizes it (a different value is refused)
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "posttrain", "vllm-serve", "--model", str(folder), "--port", "0",
                 "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--kv-cache-gb", "0.25"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self.url = self._wait_for_url(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_for_url(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(r" at (http://127\.0\.0\.1:\d+);", self.log.read_text())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)
        raise TimeoutError(f"vllm-serve did not start in {timeout_s} s:\n{self.log.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(20)
        try:  # anything left in its session (vLLM's own processes)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def server(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("vllm_server")
    srv = Server(tiny_folder(path / "model", tok), path / "server.log")
    srv.folder = path / "model"
    yield srv
    srv.stop()


def teacher_forced(model, out, temperature: float) -> torch.Tensor:
    """(N, T) log softmax(logits / T)[token] of the policy's forward over each row's prompt + response."""
    got = torch.zeros_like(out.logprobs)
    for r in range(len(out)):
        n = int(out.lengths[r])
        ids = torch.tensor(out.prompt_ids[r] + out.response_ids[r, :n].tolist())[None]
        p = len(out.prompt_ids[r])
        with torch.no_grad():
            logits = model(ids)[:, p - 1: -1]
        got[r, :n] = token_logprobs(logits, ids[:, p:], temperature)[0]
    return got


@vllm_test
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_server_rows_are_grouped_seeded_and_their_logprobs_are_the_policys(server, tok, temperature):
    model = randomized(**SHAPE)
    engine = make_engine("vllm", model, tok, server_url=server.url, timeout_s=60)
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=12, seed=3, seed_mode="row",
                            stop_token_ids=())
    out = engine.generate(PROMPTS, params)
    assert out.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and out.lengths.tolist() == [12] * 8
    gap = (teacher_forced(model, out, temperature) - out.logprobs).abs().max()
    assert float(gap) <= LOGPROB_TOL
    assert torch.equal(engine.generate(PROMPTS, params).response_ids, out.response_ids)  # per-row seeds
    tail = engine.generate(PROMPTS[2:], SamplingParams(**{**params.__dict__, "first_row": 4}))
    assert torch.equal(tail.response_ids, out.response_ids[4:])  # a row's tokens do not depend on its batch
    engine.close()


@vllm_test
def test_a_weight_push_makes_the_server_sample_from_the_new_weights(server, tok):
    old, new = randomized(**SHAPE), randomized(seed=7, **SHAPE)
    engine = make_engine("vllm", old, tok, server_url=server.url, timeout_s=60, bucket_mb=0.01)  # many buckets
    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=10, stop_token_ids=())
    native = {name: NativeEngine(m, tok).generate(PROMPTS, greedy).response_ids for name, m in
              (("old", old), ("new", new))}
    assert not torch.equal(native["old"], native["new"])
    assert torch.equal(engine.generate(PROMPTS, greedy).response_ids, native["old"])
    before = engine.client.call("/health/")["weight_updates"]
    engine.sync_weights(new)
    after = engine.generate(PROMPTS, greedy)
    assert torch.equal(after.response_ids, native["new"])
    assert float((teacher_forced(new, after, 1.0) - after.logprobs).abs().max()) <= LOGPROB_TOL
    assert engine.client.call("/health/")["weight_updates"] == before + 1
    engine.close()


@vllm_test
def test_a_push_the_server_cannot_load_is_an_error_and_it_samples_no_more_until_a_whole_push(server, tok):
    """A tensor vLLM's model does not have fails the load part-way: the engine is half updated,
    so /generate/ is refused (one line, no traceback) until the next whole push succeeds."""
    from posttrain.rollout.vllm_server import ServerError

    model = randomized(**SHAPE)
    engine = make_engine("vllm", model, tok, server_url=server.url, timeout_s=60)
    bad = randomized(seed=3, **SHAPE)
    bad.model.register_buffer("not_in_vllm", torch.zeros(3))  # a state-dict tensor vLLM has no parameter for
    with pytest.raises(ServerError, match=f"the vLLM server at {server.url}: /update_weights/ failed \\(HTTP 500\\)"):
        engine.sync_weights(bad)
    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=4, stop_token_ids=())
    with pytest.raises(ServerError, match="the weights are half updated \\(update \\d+ failed: "):
        engine.generate(PROMPTS, greedy)
    engine.sync_weights(model)  # a new group: the failed push dropped the old one
    assert torch.equal(engine.generate(PROMPTS, greedy).response_ids, NativeEngine(model, tok).generate(PROMPTS, greedy).response_ids)
    engine.close()


@vllm_test
def test_the_server_plays_the_calculator_episode_as_the_native_engine(server, tok):
    """A policy taught one tool episode, pushed to a server that started from random weights:
    one /generate/ per model turn gives the native engine's trajectory and mask."""
    from posttrain.envs import ArithmeticTools, play_episodes

    policy = teach_tool_episode(tok, "cpu")
    engine = make_engine("vllm", policy, tok, server_url=server.url, timeout_s=60)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=48)
    out, rewards, metrics = play_episodes(engine, TOOL_ROWS, ArithmeticTools, params, TOOL_LIMITS)
    assert out.meta["engine"] == "vllm-server" and out.texts == [TOOL_DEMO] * 2
    assert rewards.tolist() == [1.0, 1.0] and metrics["tool_calls/mean"] == 3.0
    check_tool_episodes(out, tok, params, TOOL_LIMITS)
    native, _, _ = play_episodes(NativeEngine(policy, tok), TOOL_ROWS, ArithmeticTools, params, TOOL_LIMITS)
    assert torch.equal(out.response_ids, native.response_ids) and torch.equal(out.response_mask, native.response_mask)
    engine.close()


def weight_updates(url: str) -> int:
    return ServerClient(url).call("/health/")["weight_updates"]


def grpo_args(data: Path, run: Path, folder: Path, url: str, steps: int) -> list[str]:
    return ["grpo", "--config", "grpo", f"model.path={folder}", f"data.train_files=[{data / 'train.jsonl'}]",
            "data.eval_files=[]", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2",
            "rollout.max_new_tokens=6", "actor.micro_batch_size=4", f"trainer.max_steps={steps}",
            "algorithm.overlong.buffer=0", f"trainer.output_dir={run}", "trainer.report_to=[]",
            "trainer.progress=false", "trainer.save_steps=0", "rollout.engine=vllm", "rollout.vllm_mode=server",
            f"rollout.server_url={url}", "rollout.server_timeout_s=60"]


@vllm_test
def test_grpo_with_the_server_trains_three_steps_and_pushes_after_each(server, tok, tmp_path):
    from posttrain.cli import main

    data = tmp_path / "data"
    make_task("arithmetic", data, n_train=16, n_test=4, seed=0, difficulty="easy")
    before = weight_updates(server.url)
    assert main(grpo_args(data, tmp_path / "run", server.folder, server.url, 3)) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "step" in m and "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert weight_updates(server.url) - before == 1 + 3  # the push at start, then one after each update
    final = BuiltinLM.from_pretrained(tmp_path / "run" / "final")  # the server holds the last update's weights
    rows = ServerClient(server.url).call("/generate/", {
        "prompts": encode_prompts(tok, PROMPTS), "seeds": [None] * 4, "max_tokens": [8] * 4,
        "sampling": {"temperature": 0, "stop_token_ids": []}})["rows"]
    native = NativeEngine(final, tok).generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8,
                                                                       stop_token_ids=()))
    assert [r["token_ids"] for r in rows] == native.response_ids.tolist()


@vllm_test
def test_a_server_killed_mid_run_stops_the_run_in_one_line(tok, tmp_path):
    """The CLI run as a user starts it: the server is killed after step 1 is logged."""
    srv = Server(tiny_folder(tmp_path / "model", tok), tmp_path / "server.log")
    data, run = tmp_path / "data", tmp_path / "run"
    make_task("arithmetic", data, n_train=64, n_test=4, seed=0, difficulty="easy")
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain", *grpo_args(data, run, tmp_path / "model", srv.url, 200)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").is_file() or '"step": 1' not in (run / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        srv.stop(signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        srv.stop()
        if proc.poll() is None:
            proc.kill()
    last = stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, stderr[-3000:]
    assert last.startswith(f"posttrain grpo: stopped: the vLLM server at {srv.url} stopped answering during "), last
    assert "Traceback" not in stderr and "restart the server (`posttrain vllm-serve --model PATH --port" in last
