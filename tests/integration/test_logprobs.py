"""Top logprobs, prompt logprobs and echo, disaggregated against colocated (real daemons, ZeroMQ and
NIXL over loopback, both real routers).

The prefill samples the first token: its alternatives reach the decode in the aux record (v2), the
prompt logprobs in the TransferResult (common/wire/aux_record.py, common/wire/messages.py). Every answer here
comes from the decode through a router and is compared with the colocated engine (token ids
exactly, logprob values within 1e-4) and with the colocated HTTP server given the same request
(the same answer, values within 1e-4), greedy and seeded, streamed and not; the OpenAI routes
through the official `openai` SDK. The prompt tokens' logprobs are also checked against an
independent reference (transformers' logits of the tiny target, then log_softmax), so the tests
fail if ``runner._input_logprobs`` drops its normalisation, which the colocated engine shares.
"""

from __future__ import annotations


import openai
import pytest
import torch

from kvferry.common.api.sampling_schema import sglang_params
from tests.cluster import Cluster, assert_pages_return, free_pages, ok, post, send_pair

TOL = 1e-4
PROMPT = "The ferry leaves the north pier at seven and"
MESSAGES = [{"role": "user", "content": "Where does the ferry go?"}]
# Routers pass floats through float32 (0.75 survives); sglang-router keeps SGLang's `sampling_seed`.
SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.75, "sampling_seed": 11}}


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_models):
    """(prefill, decode, sglang-router, vllm-router, colocated server, free pages at the start)."""
    log_dir = tmp_path_factory.mktemp("logprobs") / "logs"
    c = Cluster(log_dir, *tiny_models)
    try:
        prefill, decode, before = c.pair()
        colocated = c.colocated_server()
        yield prefill, decode, c.router([prefill], [decode]), c.vllm_router([prefill], [decode]), colocated, before
    finally:
        c.stop_all()


def close(got, want, where: str = "answer") -> None:
    """``got`` equals ``want``, floats within TOL (token ids, texts and shapes exactly)."""
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        assert abs(got - want) <= TOL, (where, got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, got, want)
        for key in want:
            close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            close(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def triples(pairs) -> list:
    return [[lp, t, None] for t, lp in pairs]


# --- /generate (SGLang's shape) --------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_generate_top_and_prompt_logprobs_equal_colocated(pd, colocated, tok_ids, hf_prompt_logprobs, sampling,
                                                          stream):
    """Fails if the prompt logprobs are not normalised (they are checked against transformers too)."""
    prefill, decode, router, _, server, before = pd
    sp = {"max_new_tokens": 6, "ignore_eos": True, **SAMPLING[sampling]}
    start, k = 2, 4
    body = {"input_ids": tok_ids, "sampling_params": sp, "return_logprob": True, "logprob_start_len": start,
            "top_logprobs_num": k, "stream": stream}
    answer = ok(post(router.url + "/generate", body))
    got = answer.events()[-1] if stream else answer.json()
    ref = colocated().generate([tok_ids], sglang_params(sp), return_logprob=True, top_logprobs_num=k)[0]
    meta = got["meta_info"]
    assert got["output_ids"] == ref.output_ids
    close(meta["output_token_logprobs"], [[lp, t, None] for t, lp in zip(ref.output_ids, ref.output_logprobs)])
    close(meta["output_top_logprobs"], [triples(alts) for alts in ref.output_top_logprobs])
    # once, not twice: sglang-router prepends the prefill's list, which is empty for this decode
    close(meta["input_token_logprobs"], [[lp, t, None] for t, lp in zip(tok_ids[start:], ref.input_logprobs[start:])])
    close([lp for lp, _, _ in meta["input_token_logprobs"]], hf_prompt_logprobs[start:], "transformers")
    close(meta["input_top_logprobs"], [triples(alts) for alts in ref.input_top_logprobs[start:]])
    same = ok(post(server.url + "/generate", body))
    same = same.events()[-1] if stream else same.json()
    close({k: v for k, v in same["meta_info"].items() if "logprobs" in k},
          {k: v for k, v in meta.items() if "logprobs" in k})
    assert_pages_return([prefill, decode], before)


def test_generate_through_vllm_router_keeps_output_logprobs_only(pd, tok_ids):
    """vllm-router 0.1.17 re-serializes /generate bodies without `top_logprobs_num` and
    `logprob_start_len` (docs/routers.md): the decode answers the output logprobs, which equal the
    colocated server's, and no prompt or top logprobs. The OpenAI routes carry them (below)."""
    _, _, _, vllm, server, _ = pd
    body = {"input_ids": tok_ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
    got = ok(post(vllm.url + "/generate", body)).json()
    want = ok(post(server.url + "/generate", body)).json()
    assert got["output_ids"] == want["output_ids"]
    close(got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"])
    assert got["meta_info"]["input_token_logprobs"] == [] and "output_top_logprobs" not in got["meta_info"]


@pytest.fixture(scope="module")
def tok_ids(tiny_models) -> list[int]:
    from kvferry.common.text.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_models[0]).encode(PROMPT)


@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_models, tok_ids) -> list[float | None]:
    """Each prompt token's logprob given its prefix from transformers (log_softmax of its logits);
    None for the first token."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_models[0], dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([tok_ids])).logits[0].float(), dim=-1)
    return [None] + [float(logprobs[j - 1, tok_ids[j]]) for j in range(1, len(tok_ids))]


# --- OpenAI routes through the official SDK --------------------------------------------------------

def client(proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", timeout=120, max_retries=0)


def completion(proc, stream: bool, **kw) -> dict:
    """A completion as one object; a stream's chunks are joined (text, and each logprobs list)."""
    args = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "logprobs": 3, "echo": True, **kw}
    if not stream:
        choice = client(proc).completions.create(**args).choices[0]
        return {"text": choice.text, "logprobs": choice.logprobs.model_dump()}
    text, logprobs = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client(proc).completions.create(**args, stream=True):
        for choice in chunk.choices:
            text += choice.text
            for key, values in (choice.logprobs.model_dump() if choice.logprobs else {}).items():
                logprobs[key] += values or []
    return {"text": text, "logprobs": logprobs}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_completions_echo_with_top_logprobs_equals_colocated(pd, colocated, tok_ids, hf_prompt_logprobs, sampling,
                                                             stream):
    """Fails if the echoed prompt logprobs are not normalised (checked against transformers too)."""
    _, _, router, _, server, _ = pd
    extra = {"temperature": SAMPLING[sampling]["temperature"], "seed": SAMPLING[sampling].get("sampling_seed")}
    got = completion(router, stream, **extra)
    close(got, completion(server, stream, **extra))
    ref = colocated().generate([tok_ids], sglang_params({"max_new_tokens": 5, **SAMPLING[sampling]}),
                               return_logprob=True, top_logprobs_num=3)[0]
    lp = got["logprobs"]
    assert got["text"].startswith(PROMPT) and got["text"].endswith(ref.text)
    assert len(lp["tokens"]) == len(tok_ids) + len(ref.output_ids)
    close(lp["token_logprobs"], [None] + ref.input_logprobs[1:] + ref.output_logprobs)
    close(lp["token_logprobs"][:len(tok_ids)], hf_prompt_logprobs, "transformers")
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][len(tok_ids)]) <= 4  # 3 and the chosen one
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_completions_echo_through_vllm_router(pd):
    _, _, _, vllm, server, _ = pd
    close(completion(vllm, False, temperature=0), completion(server, False, temperature=0))


def test_completions_top_logprobs_without_echo(pd):
    _, _, router, _, server, _ = pd
    got = completion(router, False, echo=False, logprobs=5, temperature=0)
    close(got, completion(server, False, echo=False, logprobs=5, temperature=0))
    assert len(got["logprobs"]["tokens"]) == 5 and all(len(t) <= 6 for t in got["logprobs"]["top_logprobs"])


def chat(proc, stream: bool, **kw) -> dict:
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "logprobs": True, "top_logprobs": 3, **kw}
    if not stream:
        choice = client(proc).chat.completions.create(**args).choices[0]
        return {"text": choice.message.content, "content": choice.logprobs.model_dump()["content"]}
    text, content = "", []
    for chunk in client(proc).chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            content += choice.logprobs.model_dump()["content"] if choice.logprobs else []
    return {"text": text, "content": content}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_chat_top_logprobs_equal_colocated(pd, sampling, stream):
    _, _, router, vllm, server, _ = pd
    extra = {"temperature": SAMPLING[sampling]["temperature"], "seed": SAMPLING[sampling].get("sampling_seed")}
    want = chat(server, stream, **extra)
    got = chat(router, stream, **extra)
    close(got, want)
    assert len(got["content"]) == 6 and all(len(c["top_logprobs"]) == 3 for c in got["content"])
    close(chat(vllm, stream, **extra), want)


def test_a_bad_value_is_a_400_naming_it_through_the_router(pd):
    _, _, router, _, _, _ = pd
    with pytest.raises(openai.BadRequestError) as info:
        client(router).chat.completions.create(model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=21)
    assert "top_logprobs" in str(info.value)


@pytest.mark.parametrize("stream", [False, True])
def test_scoring_a_prompt_with_echo_and_max_tokens_0(pd, colocated, tok_ids, hf_prompt_logprobs, stream):
    """What evaluation harnesses send to score a text: the prompt's logprobs, nothing generated, equal
    to transformers' log_softmax. Fails if ``runner._input_logprobs`` drops its normalisation."""
    _, _, router, _, server, _ = pd
    got = completion(router, stream, max_tokens=0, logprobs=1, temperature=0)
    close(got, completion(server, stream, max_tokens=0, logprobs=1, temperature=0))
    ref = colocated().generate([tok_ids], sglang_params({"max_new_tokens": 0}), return_logprob=True)[0]
    assert got["text"] == PROMPT and len(got["logprobs"]["tokens"]) == len(tok_ids)
    close(got["logprobs"]["token_logprobs"], [None] + ref.input_logprobs[1:])
    close(got["logprobs"]["token_logprobs"], hf_prompt_logprobs, "transformers")


def test_prompt_logprobs_over_the_prefill_limit_end_both_legs_with_the_reason(cluster):
    """The prefill refuses more prompt positions than --max-prompt-logprob-tokens (a 400 naming
    logprob_start_len); the decode, which accepted the request, gets the reason in the room's
    transfer_result at once and answers with it, and both sides' pages come back."""
    prefill = cluster.prefill(extra=["--max-prompt-logprob-tokens", "4"])
    decode = cluster.decode()
    before = {p.name: free_pages(p) for p in (prefill, decode)}
    body = {"input_ids": list(range(5, 25)), "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0}
    for order in ("concurrent", "decode_first"):
        (ps, pa), (ds, da) = send_pair(prefill, decode, body, order=order)
        assert ps == 400 and pa["error"]["param"] == "logprob_start_len", pa
        assert ds == 502 and "returns at most 4" in da["error"]["message"], da
    assert_pages_return([prefill, decode], before)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_top_logprobs_with_a_draft_on_the_decode_equal_colocated(cluster, colocated, tok_ids, sampling):
    """Decode-only speculative decoding: each verified token's alternatives come from the target's
    verify logits; tokens and values equal the colocated engine with the same draft."""
    prefill, decode = cluster.prefill(), cluster.decode(draft=True)
    sp = {"max_new_tokens": 8, "ignore_eos": True, **SAMPLING[sampling]}
    body = {"input_ids": tok_ids, "sampling_params": sp, "return_logprob": True, "logprob_start_len": 1,
            "top_logprobs_num": 3}
    (ps, pa), (ds, got) = send_pair(prefill, decode, body)
    assert ps == 200 and ds == 200, (pa, got)
    ref = colocated(True).generate([tok_ids], sglang_params(sp), return_logprob=True, top_logprobs_num=3)[0]
    meta = got["meta_info"]
    assert got["output_ids"] == ref.output_ids and meta["spec_num_proposed"] > 0
    close(meta["output_top_logprobs"], [triples(alts) for alts in ref.output_top_logprobs])
    close(meta["input_top_logprobs"], [triples(alts) for alts in ref.input_top_logprobs[1:]])
    assert pa["meta_info"]["input_token_logprobs"] == []  # the decode returns them (sglang-router merges)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_first_token_logprob_equals_its_entry_among_the_alternatives(cluster, tok_ids, sampling):
    """The first token comes from the prefill (aux record): its logprob and its entry among its own
    top logprobs are one value, exactly, and both equal the colocated server's (fails if the record
    carries the alternatives in another precision than the chosen token's logprob)."""
    prefill, decode, server = cluster.prefill(), cluster.decode(), cluster.colocated_server()
    sp = {"max_new_tokens": 2, "ignore_eos": True, **SAMPLING[sampling]}
    body = {"input_ids": tok_ids, "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 20}
    (ps, pa), (ds, got) = send_pair(prefill, decode, body)
    assert ps == 200 and ds == 200, (pa, got)
    want = ok(post(server.url + "/generate", body)).json()
    lp, token, _ = got["meta_info"]["output_token_logprobs"][0]
    alts = {t: v for v, t, _ in got["meta_info"]["output_top_logprobs"][0]}
    assert token in alts, (token, alts)
    assert alts[token] == lp
    assert got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["output_token_logprobs"][0] == want["meta_info"]["output_token_logprobs"][0]
    assert got["meta_info"]["output_top_logprobs"][0] == want["meta_info"]["output_top_logprobs"][0]
