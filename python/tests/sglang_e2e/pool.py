"""The servers this directory's tests share, started once a session (each SGLang server takes
a minute or more on the 2-core host): a single server's answers, taken first and the server
stopped (the reference), then a prefill + decode pair over kvbridge, whose prefill a test may
kill and restart on the same ports. Servers start one at a time and are killed as whole
process groups."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm_e2e"))
import bodies  # noqa: E402
import standins  # noqa: E402
import tiny_model  # noqa: E402
from sglang_servers import SglangServer, free_ports, http_json, pd_pair, prefill_server, wait_healthy  # noqa: E402


@dataclass
class Env:
    root: Path
    model: Path
    standins: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"


@dataclass
class References:
    """The single server's answers: ``generate[i]`` for ``bodies.PROMPTS[i]``, and
    ``openai[(api, i)]`` (text, tokens with top logprobs) for ``bodies.PROXY_PROMPTS[i]``."""

    generate: list = field(default_factory=list)
    openai: dict = field(default_factory=dict)


class Pair:
    """A prefill and a decode server over kvbridge; ``restart_prefill`` starts a new prefill
    on the same HTTP and bootstrap ports."""

    def __init__(self, env: Env):
        self.env = env
        self.prefill, self.decode, self.bport = pd_pair(env.model, env.logs, env.standins)
        self.restarts = 0
        self.started_in = wait_healthy([self.prefill, self.decode])

    def restart_prefill(self) -> float:
        self.prefill.kill()
        self.restarts += 1
        self.prefill = prefill_server(
            self.env.model, self.env.logs, self.env.standins, self.prefill.port, self.bport,
            name=f"prefill-{self.restarts}",
        )  # fmt: skip
        return wait_healthy([self.prefill])

    def stop(self) -> None:
        self.prefill.kill()
        self.decode.kill()


@pytest.fixture(scope="session")
def env(tmp_path_factory) -> Env:
    root = tmp_path_factory.mktemp("sglang_e2e")
    (root / "logs").mkdir()
    return Env(root, tiny_model.build(root / "model"), standins.write(root / "standins"))


@pytest.fixture(scope="session")
def references(env: Env) -> References:
    s = SglangServer("single", env.model, free_ports(1)[0], env.logs, env.standins)
    try:
        print(f"\nsingle SGLang server healthy in {wait_healthy([s]):.0f} s")
        refs = References()
        for p in bodies.PROMPTS:
            status, resp = http_json(f"{s.url}/generate", bodies.generate(p))
            assert status == 200, resp
            refs.generate.append(resp)
        for api in bodies.APIS:
            for i, p in enumerate(bodies.PROXY_PROMPTS):
                refs.openai[(api, i)] = bodies.openai_answer(s.url, api, env.model, p, stream=False)
        return refs
    finally:
        s.kill()


@pytest.fixture(scope="session")
def pair(env: Env, references: References):
    """Made after the references: the single server is gone by then."""
    p = Pair(env)
    try:
        print(f"prefill + decode healthy in {p.started_in:.0f} s")
        yield p
    finally:
        p.stop()
