"""The requests these tests send and how their answers are read: SGLang's native /generate and
the OpenAI completions and chat APIs, greedy, with top logprobs."""

from __future__ import annotations

from pathlib import Path

from sglang_servers import choice_tokens, post, post_stream

PROMPTS = [
    "the cat sat on the old stone by the river and",
    "one two three four five six seven eight nine ten and the",
    "where is the blue ship that was on the sea at night when the moon",
    "a long story of the red bird and the green tree in the rain " * 6,
]
#: Prompts sent through the proxy (several chunks each, at sglang_servers.CHUNK_TOKENS).
PROXY_PROMPTS = [
    "the old dog and the white cat were by the door of the house when the rain " * 4,
    "one bird two fish three trees and four stars in the dark sky over the sea " * 5,
]
#: A prompt of about 3000 tokens: about a hundred prefill steps, time for a kill to land
#: while its KV is leaving chunk by chunk.
LONG_PROMPT = "the red ship on the blue sea and a green tree by the old stone house " * 200
APIS = ("completions", "chat")
#: (api, index in PROXY_PROMPTS, streamed) of the requests sent through a router.
CASES = [(api, i, stream) for api in APIS for i in range(len(PROXY_PROMPTS)) for stream in (False, True)]
MAX_NEW = 8
TOP = 3
#: Largest difference of a top logprob allowed between two servers' answers (the printed
#: runs show 0.0000; batches of other sizes may move the last bits of bf16).
LOGPROB_TOLERANCE = 0.05


def generate(prompt: str, **extra) -> dict:
    return {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW},
        "return_logprob": True,
        "top_logprobs_num": TOP,
        **extra,
    }


def top_logprobs(resp: dict) -> list:
    """[(token id, logprob)] of the top candidates at each output position (/generate)."""
    rows = resp.get("meta_info", {}).get("output_top_logprobs") or []
    return [[(c[1], c[0]) for c in row] for row in rows if row]


def ids(resp: dict) -> list:
    return resp.get("output_ids") or resp["meta_info"].get("output_token_ids") or []


def openai(api: str, model: Path, prompt: str, stream: bool, max_tokens: int = MAX_NEW) -> tuple[str, dict]:
    """The path and body of a greedy request of ``api`` (completions or chat)."""
    if api == "completions":
        doc = {"prompt": prompt, "logprobs": TOP}
    else:
        doc = {"messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": TOP}
    doc.update(model=str(model), max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=stream)
    return f"/v1/{'completions' if api == 'completions' else 'chat/completions'}", doc


def choice_text(api: str, choices: list) -> str:
    """The answer's text, from a whole answer's choices or a stream's events' choices."""
    if api == "completions":
        return "".join(c.get("text") or "" for c in choices)
    return "".join((c.get("message") or c.get("delta") or {}).get("content") or "" for c in choices)


def openai_answer(base: str, api: str, model: Path, prompt: str, stream: bool, timeout: float = 300.0) -> tuple[str, list]:
    """The text of a greedy answer from ``base`` and each of its tokens with its top logprobs."""
    path, doc = openai(api, model, prompt, stream)
    if stream:
        status, events, raw = post_stream(base + path, doc, timeout=timeout)
        assert status == 200, raw[-2000:]
        choices = [c for e in events for c in e.get("choices", [])]
    else:
        status, body = post(base + path, doc, timeout=timeout)
        assert status == 200, body
        choices = body["choices"]
    tokens = choice_tokens(api, choices)
    assert len(tokens) == MAX_NEW, (len(tokens), choices)
    return choice_text(api, choices), tokens


def assert_same_answer(got: tuple[str, list], want: tuple[str, list]) -> float:
    """Same text, tokens and top candidates; returns the largest logprob difference."""
    assert got[0] == want[0], (got[0], want[0])
    assert [t for t, _ in got[1]] == [t for t, _ in want[1]], "generated tokens differ"
    diff = 0.0
    for i, ((_, g), (_, w)) in enumerate(zip(got[1], want[1])):
        assert set(g) == set(w), f"token {i}: top candidates differ: {g} != {w}"
        diff = max([diff] + [abs(g[k] - w[k]) for k in g])
    assert diff < LOGPROB_TOLERANCE, diff
    return diff
