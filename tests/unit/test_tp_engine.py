"""Tensor-parallel engine on CPU (gloo): rank 0 in this process, ranks 1..N-1 as
``python -m kvferry.common.engine.tp_worker`` processes. Greedy output at TP 2 and TP 4 equals TP 1 token
for token (float32; prompts of 1 to 300 tokens, prefill then 16 tokens through the overlapped
decode path, and n > 1 forks whose copied page must reach every rank), on the embedded tiny
checkpoint (4 attention heads, 2 KV heads: TP 4 replicates each KV head on two ranks) and on
``tiny-kv8`` (8 KV heads, split in blocks) at TP 2; the groups start together once and serve every
case. The sharded model alone (ranks as threads, no processes) covers every (model, TP 2 | 4) pair.
Also: each rank's weights are slices of the checkpoint that concatenate back to it, the refusals
name their option, the step codec round-trips, and workers never outlive rank 0, whether it
closes, dies, or sees a worker die."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from kvferry.common.engine.colocated import ColocatedEngine
from kvferry.common.engine.factory import build_runner, check_tp_options
from kvferry.common.engine.fork import fork
from kvferry.common.engine.sequence import Sequence
from kvferry.common.engine.tp_group import TpWorkerError
from kvferry.common.engine.tp_step import HEADER_BYTES, StepHeader, StepKind, decode_forward, encode_forward
from kvferry.common.errors import ProtocolError
from kvferry.common.models.config import ModelConfig
from kvferry.common.models.llama import SeqChunk
from kvferry.common.models.loader import load_model
from kvferry.common.sampling.grammar import GrammarSpec
from kvferry.common.sampling.sampler import SamplingParams
from kvferry.common.text.tokenizer import Tokenizer
from kvferry.common.models.tiny import make_tiny_model
from kvferry.common.layers.tp_layers import TpConfigError, TpShard
from tests.cluster import tiny_model_dirs
from tests.tp_threads import greedy_in_threads

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
PAGE_SIZE = 16
NUM_STEPS = 16
PROMPTS = [[7], [(i * 37 + 11) % 500 for i in range(45)], [(i * 13 + 5) % 500 for i in range(300)]]


@pytest.fixture(scope="module")
def kv8_dir(tmp_path_factory) -> str:
    target, _ = make_tiny_model(tmp_path_factory.mktemp("kv8"), seed=1, preset="tiny-kv8")
    return str(target)


def _dir(name: str, kv8_dir: str) -> str:
    return tiny_model_dirs()[0] if name == "tiny" else kv8_dir


def _runner(model_dir: str, tp_size: int):
    torch.set_num_threads(1)
    return build_runner(model_dir, page_size=PAGE_SIZE, max_total_tokens=4096, dtype="float32",
                        tp_size=tp_size, tp_num_threads=1)


@pytest.fixture(scope="module")
def references(kv8_dir) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """TP 1 outputs of each model: (batch of PROMPTS, forks of the 45-token prompt)."""
    out = {}
    for name in ("tiny", "kv8"):
        runner = _runner(_dir(name, kv8_dir), 1)
        out[name] = (_generate(runner, PROMPTS), _forked(runner, PROMPTS[1], 3))
    return out


GROUPS = [("tiny", 2), ("tiny", 4), ("kv8", 2)]  # kv8 at TP 4: test_model_shards_in_threads_equal_tp1
DOOMED = ("kv8", 2, "doomed")  # a group of its own, which test_a_failed_worker_fails_the_step breaks


@pytest.fixture(scope="module")
def tp_runners(kv8_dir):
    """Every group this module uses, started at once (most of a start is a worker importing torch)."""
    keys = [*GROUPS, DOOMED]
    with ThreadPoolExecutor(len(keys)) as pool:
        futures = {key: pool.submit(_runner, _dir(key[0], kv8_dir), key[1]) for key in keys}
    runners = {}
    try:
        for key, future in futures.items():
            runners[key] = future.result()
        yield runners
    finally:
        pids = [pid for runner in runners.values() for pid in runner.target.tp.worker_pids]
        with ThreadPoolExecutor(max(len(runners), 1)) as pool:
            list(pool.map(lambda runner: runner.close(), runners.values()))
        assert _wait_gone(pids) == [], "close() left TP workers running"


@pytest.fixture(params=GROUPS, ids=lambda p: f"{p[0]}-tp{p[1]}")
def tp_runner(request, tp_runners):
    return request.param[0], tp_runners[request.param]


def _seqs(prompts: list[list[int]]) -> list[Sequence]:
    params = SamplingParams(max_new_tokens=NUM_STEPS, temperature=0)
    return [Sequence(f"r{i}", list(p), params) for i, p in enumerate(prompts)]


def _generate(runner, prompts: list[list[int]]) -> list[list[int]]:
    """One batched prefill, then NUM_STEPS - 1 decode steps, each launched before the previous
    step's tokens are read (they reach the next forward from the device: ``TokenFeed``)."""
    seqs = _seqs(prompts)
    for s in seqs:
        runner.admit(s)
    runner.prefill(seqs)
    prev = None
    for _ in range(NUM_STEPS - 1):
        step = runner.launch_decode(seqs, prev)
        if prev is not None:
            for s, [(token, _)] in zip(prev.seqs, prev.result()):
                s.output_ids.append(token)
        prev = step
    for s, [(token, _)] in zip(prev.seqs, prev.result()):
        s.output_ids.append(token)
    for s in seqs:
        runner.release(s)
    return [s.output_ids for s in seqs]


def _forked(runner, prompt: list[int], n: int) -> list[list[int]]:
    """A prefill forked into n completions (the last prompt page copied on every rank), decoded together."""
    parent, *children = _seqs([prompt] * n)
    runner.admit(parent)
    runner.prefill([parent])
    fork(runner, parent, children)
    seqs = [parent, *children]
    for _ in range(NUM_STEPS // 2):
        for s, pairs in zip(seqs, runner.decode(seqs)):
            s.output_ids.extend(token for token, _ in pairs)
    for s in seqs:
        runner.release(s)
    return [s.output_ids for s in seqs]


def test_greedy_output_equals_tp1(tp_runner, references):
    name, runner = tp_runner
    assert _generate(runner, PROMPTS) == references[name][0]
    assert runner.target.allocator.num_free == runner.target.allocator.num_pages


def test_forks_equal_tp1(tp_runner, references):
    name, runner = tp_runner
    assert _forked(runner, PROMPTS[1], 3) == references[name][1]


def test_each_rank_holds_its_heads(tp_runner):
    name, runner = tp_runner
    config, kv, tp_size = runner.target.model.config, runner.target.kv, runner.target.tp.spec.tp_size
    assert kv.num_kv_heads == max(config.num_key_value_heads // tp_size, 1)
    assert [r.num_heads for r in kv.regions()] == [kv.num_kv_heads] * 2 * config.num_hidden_layers
    assert len(runner.target.tp.worker_pids) == tp_size - 1


@pytest.mark.parametrize("name", ["tiny", "kv8"])
def test_model_shards_in_threads_equal_tp1(name, kv8_dir):
    """The sharded model alone, every (model, TP) pair: ranks as threads (tests/tp_threads.py)."""
    reference = greedy_in_threads(_dir(name, kv8_dir), 1)
    for tp_size in (2, 4):
        assert greedy_in_threads(_dir(name, kv8_dir), tp_size) == reference, f"tp_size={tp_size}"


@pytest.mark.parametrize("name,tp_size", [("tiny", 2), ("tiny", 4), ("kv8", 2), ("kv8", 4)])
def test_rank_shards_concatenate_to_the_checkpoint(name, tp_size, kv8_dir):
    model_dir = _dir(name, kv8_dir)
    full = load_model(model_dir, dtype="float32")
    ranks = [load_model(model_dir, dtype="float32", tp_size=tp_size, tp_rank=r) for r in range(tp_size)]
    c, whole = full.config, full.layers[1]
    parts = [m.layers[1] for m in ranks]
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    qkv = [p.qkv_weight.split([p.shard.q_size, p.shard.kv_size, p.shard.kv_size]) for p in parts]
    assert torch.equal(torch.cat([x[0] for x in qkv]), whole.qkv_weight[:q])
    for p, (_, k, v) in zip(parts, qkv):  # each rank's KV heads, replicated or not
        rows = slice(p.shard.kv_heads.start * c.head_dim, p.shard.kv_heads.stop * c.head_dim)
        assert torch.equal(k, whole.qkv_weight[q:q + kv][rows])
        assert torch.equal(v, whole.qkv_weight[q + kv:][rows])
    gate_up = [p.gate_up_weight.chunk(2) for p in parts]
    assert torch.equal(torch.cat([g for g, _ in gate_up]), whole.gate_up_weight[:inter])
    assert torch.equal(torch.cat([u for _, u in gate_up]), whole.gate_up_weight[inter:])
    assert torch.equal(torch.cat([p.o_weight for p in parts], dim=1), whole.o_weight)
    assert torch.equal(torch.cat([p.down_weight for p in parts], dim=1), whole.down_weight)
    for m in ranks:  # replicated
        assert torch.equal(m.embed, full.embed) and torch.equal(m.lm_head, full.lm_head)
        assert torch.equal(m.layers[1].input_norm, whole.input_norm)


def test_draft_beside_a_tp_target_decodes_like_tp1(references):
    """Speculative decoding at TP 2: the draft runs unsharded on rank 0, the target verifies over
    both ranks; greedy output equals the TP-1 engine without a draft, and each prompt's acceptance
    equals the TP-1 engine's with the same draft, at least half of the proposals (the tiny draft
    agrees with the target most of the time). Fails if the draft's prompt KV is not filled
    (``ModelRunner.prefill_draft`` skipping its forward: 0.09-0.42 accepted), which output cannot
    show (the target verifies every token)."""
    target, draft = tiny_model_dirs()
    torch.set_num_threads(1)
    runner = build_runner(target, draft, page_size=PAGE_SIZE, max_total_tokens=4096, dtype="float32", tp_size=2,
                          tp_num_threads=1)
    try:
        assert runner.draft is not None and runner.draft.tp is None and runner.target.tp is not None
        engine = ColocatedEngine(runner, Tokenizer.from_dir(target))
        params = SamplingParams(max_new_tokens=NUM_STEPS, temperature=0, ignore_eos=True)
        got = engine.generate(PROMPTS, params)
        assert [r.output_ids for r in got] == references["tiny"][0]
    finally:
        runner.close()
    tp1 = ColocatedEngine(build_runner(target, draft, page_size=PAGE_SIZE, max_total_tokens=4096, dtype="float32"),
                          Tokenizer.from_dir(target)).generate(PROMPTS, params)
    assert [r.acceptance_rate for r in got] == pytest.approx([r.acceptance_rate for r in tp1])
    assert all(r.acceptance_rate >= 0.5 for r in got), [r.acceptance_rate for r in got]


def test_refusals_name_the_option():
    target, _ = tiny_model_dirs()
    with pytest.raises(ValueError, match="--disable-cuda-graph"):
        check_tp_options(2, device="cuda:0", cuda_graphs=True)
    check_tp_options(2, device="cuda:0", cuda_graphs=False)
    check_tp_options(2, device="cpu", cuda_graphs=True)  # CPU captures no graphs anyway
    config = ModelConfig.from_dir(target)  # 4 attention heads, 2 KV heads
    with pytest.raises(TpConfigError, match="--tp-size 3"):
        build_runner(target, tp_size=3)
    with pytest.raises(TpConfigError, match="--tp-size 8"):
        TpShard.of(config, 8, 0)  # 4 attention heads cannot split 8 ways
    assert TpShard.of(config, 4, 3).kv_heads.start == 1  # replicated: ranks 2 and 3 hold head 1


_chunks = st.lists(st.builds(SeqChunk, st.lists(st.integers(0, 2**40), min_size=1, max_size=20),
                             st.integers(0, 10**6), st.lists(st.integers(0, 10**6), max_size=8)), min_size=1, max_size=6)


@given(_chunks)
def test_step_codec_round_trips(chunks):
    header, payload = encode_forward(chunks)
    again = StepHeader.decode(header.encode())
    assert again == header and again.payload_len == len(payload)
    assert decode_forward(again, payload) == chunks


def test_step_header_refuses_what_it_does_not_know():
    copy = StepHeader(StepKind.COPY_PAGE, src_page=4, dst_page=11)
    assert StepHeader.decode(copy.encode()) == copy and copy.payload_len == 0
    with pytest.raises(ProtocolError, match="magic"):
        StepHeader.decode(b"\0" * HEADER_BYTES)
    with pytest.raises(ProtocolError, match="kind 9"):
        StepHeader.decode(copy.encode()[:8] + (9).to_bytes(8, "little") + copy.encode()[16:])
    header, payload = encode_forward([SeqChunk([1, 2], 0, [0])])
    with pytest.raises(ProtocolError, match="payload"):
        decode_forward(header, payload[:-1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; only its parent's wait is missing
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pids: list[int], timeout_s: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


_RANK0 = """
import sys, torch
from kvferry.common.engine.factory import build_runner
runner = build_runner(sys.argv[1], page_size=16, max_total_tokens=1024, tp_size=2, tp_num_threads=1)
print(" ".join(map(str, runner.target.tp.worker_pids)), flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_workers_exit_when_rank0_is_killed():
    proc = subprocess.Popen([sys.executable, "-c", _RANK0, tiny_model_dirs()[0]], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1 and _alive(pids[0])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert _wait_gone(pids) == []


def test_a_failed_worker_fails_the_step_then_close_reaps(tp_runners):
    runner = tp_runners[DOOMED]
    try:
        [pid] = runner.target.tp.worker_pids
        runner.target.tp.copy_page(10**6, 0)  # a page outside the worker's pool: it raises and exits 1
        seqs = _seqs([PROMPTS[1]])
        runner.admit(seqs[0])
        with pytest.raises(TpWorkerError, match=r"rank 1 \(pid \d+\) exited with code 1"):
            runner.prefill(seqs)  # the worker died before or during this step's collectives
        with pytest.raises(TpWorkerError, match="rank 1"):  # and every later step says so
            runner.decode(seqs)
    finally:
        runner.close()
    assert runner.target.tp.state.value == "closed" and _wait_gone([pid]) == []


def test_colocated_engine_features_on_rank0(tp_runners):
    """Sampling runs on rank 0 alone, so what acts on logits works unchanged at TP 2: a regex
    grammar, penalties, seeded sampling, top logprobs and prompt logprobs (a prefill pass with
    every row's logits) give TP 1's tokens, and logprobs within float32 noise; the prompt logprobs
    also equal transformers' log_softmax (fails if ``runner._input_logprobs`` drops its
    normalisation, which TP 1 shares)."""
    tokenizer = Tokenizer.from_dir(tiny_model_dirs()[0])
    params = [SamplingParams(max_new_tokens=10, temperature=0, grammar=GrammarSpec("regex", "(ab|cd)+e", "regex")),
              SamplingParams(max_new_tokens=10, temperature=0.8, seed=5, repetition_penalty=1.3,
                             frequency_penalty=0.5),
              SamplingParams(max_new_tokens=10, temperature=0, logit_bias=((65, 5.0),), min_new_tokens=4)]
    prompts = ["Once upon a time", "The quick brown fox jumps over", "Hello"]
    results = []
    for runner in (_runner(tiny_model_dirs()[0], 1), tp_runners[("tiny", 2)]):
        engine = ColocatedEngine(runner, tokenizer)
        results.append(engine.generate(prompts, params, return_logprob=True, top_logprobs_num=3))
    for tp1, tp2 in zip(*results):
        assert tp2.output_ids == tp1.output_ids
        assert tp2.output_logprobs == pytest.approx(tp1.output_logprobs, abs=1e-4)
        assert tp2.input_logprobs[1:] == pytest.approx(tp1.input_logprobs[1:], abs=1e-4)
        assert [[t for t, _ in alts] for alts in tp2.output_top_logprobs] == \
            [[t for t, _ in alts] for alts in tp1.output_top_logprobs]
    assert results[1][0].text and set(results[1][0].text) <= set("abcde")  # the grammar held
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dirs()[0], dtype=torch.float32).eval()
    for prompt, tp2 in zip(prompts, results[1]):
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        assert tp2.input_logprobs[1:] == pytest.approx([float(ref[j - 1, ids[j]]) for j in range(1, len(ids))],
                                                       abs=1e-4)


def test_fp8_kv_at_tp2_equals_tp1(tmp_path):
    """--kv-cache-dtype fp8_e4m3 at TP 2: every rank builds an FP8 pool with the checkpoint's scales
    (K/V scaled into e4m3's coarse subnormal range, where FP8 changes this model's greedy tokens), so
    output equals the TP-1 FP8 engine's and not the full-precision pool's."""
    target = tmp_path / "scaled"
    shutil.copytree(tiny_model_dirs()[0], target)
    tensors = load_file(str(target / "model.safetensors"))
    for i in range(ModelConfig.from_dir(target).num_hidden_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(128.0)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(96.0)
    save_file(tensors, str(target / "model.safetensors"))
    torch.set_num_threads(1)

    def greedy(tp_size: int, kv_cache_dtype: str) -> list[list[int]]:
        runner = build_runner(str(target), page_size=PAGE_SIZE, max_total_tokens=4096, dtype="float32",
                              tp_size=tp_size, tp_num_threads=1, kv_cache_dtype=kv_cache_dtype)
        try:
            assert runner.target.kv.kv_dtype == ("float32" if kv_cache_dtype == "auto" else "float8_e4m3fn")
            return _generate(runner, PROMPTS)
        finally:
            runner.close()

    tp1 = greedy(1, "fp8_e4m3")
    assert greedy(2, "fp8_e4m3") == tp1
    assert greedy(1, "auto") != tp1
