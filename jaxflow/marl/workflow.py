"""Multi-agent workflows as data: agents (model, role, reward) and who sees whose output.

A :class:`Workflow` is a frozen description; nothing here runs a model. Each agent names a
reward (a built-in verifiable task, see ``REWARDS``); an :class:`Edge` ``source -> target``
means the target's prompt is built from the source's prompt and completion, so the target
acts one turn after the source. Turns are the longest-path depth in the (acyclic) edge graph.

Built in: :func:`solver_verifier_workflow` -- a solver answers ``"a+b="`` and a (different
size) verifier reads ``"a+b:c="`` (c = the solver's answer) and says ``"1"`` (correct) or
``"0"``; the verifier's reward is 1 when its verdict is right.

Example::

    wf = solver_verifier_workflow(small_cfg, tiny_cfg)
    wf.order()            # ("solver", "verifier")
    wf.turn("verifier")   # 1
"""

from __future__ import annotations

import dataclasses

from jaxflow.models.transformer import TransformerConfig
from jaxflow.rl.tasks import AdditionRLTask, Task


@dataclasses.dataclass(frozen=True)
class VerifyAdditionTask:
    """Turn-1 task: prompt ``"a+b:c="``; completion ``"1"`` iff ``c == a + b``, else ``"0"``."""

    max_digits: int = 2
    name: str = "verify_addition"

    def __post_init__(self):
        self._solver  # noqa: B018  (checks max_digits: 1..9)

    @property
    def _solver(self) -> AdditionRLTask:
        return AdditionRLTask(max_digits=self.max_digits)

    @property
    def max_prompt_len(self) -> int:
        # "a+b" + ":" + the solver's answer (at most its max completion + 1 chars) + "="
        """Characters of the longest prompt: the sum, ``:``, the solver's longest answer and ``=``."""
        return self._solver.max_prompt_len + self._solver.max_completion_len + 2

    @property
    def max_completion_len(self) -> int:
        """One character: the verdict ``1`` or ``0``."""
        return 1

    def from_upstream(self, prompt: str, completion: str | None) -> str:
        """The verifier's prompt for a solver ``prompt`` and its ``completion`` (None: no EOS)."""
        answer = (completion or "")[: self._solver.max_completion_len + 1]
        return prompt.rstrip("=") + ":" + answer + "="

    def prompts(self, rng, n: int) -> list[str]:
        # standalone use: half right, half wrong answers
        """``n`` standalone prompts, half with a right and half with a wrong answer."""
        out = []
        for p in self._solver.prompts(rng, n):
            a, b = (int(x) for x in p.rstrip("=").split("+"))
            out.append(self.from_upstream(p, str(a + b + int(rng.integers(0, 2)))))
        return out

    def heldout_prompts(self, n: int, seed: int = 1234) -> list[str]:
        """``n`` held-out standalone prompts (a fixed seed)."""
        import numpy as np
        return self.prompts(np.random.default_rng([seed, 0x7E21]), n)

    def score(self, prompt: str, completion: str) -> float:
        """1.0 if the verdict matches whether the prompt's answer is right, else 0.0."""
        lhs, _, answer = prompt[:-1].partition(":")
        correct = self._solver.score(lhs + "=", answer) == 1.0
        return float(completion == ("1" if correct else "0"))


REWARDS = ("addition", "verify_addition")


def make_reward_task(reward: str, max_digits: int) -> Task:
    """The task that scores an agent with reward ``reward`` (one of ``REWARDS``)."""
    if reward == "addition":
        return AdditionRLTask(max_digits=max_digits)
    if reward == "verify_addition":
        return VerifyAdditionTask(max_digits=max_digits)
    raise ValueError(f"unknown reward {reward!r}; valid: {REWARDS}")


@dataclasses.dataclass(frozen=True)
class AgentSpec:
    """One trained policy: its architecture, role name, reward and sampling shape."""

    name: str
    model: TransformerConfig
    role: str
    reward: str
    group_size: int = 4
    max_new_tokens: int = 4

    def __post_init__(self):
        if self.reward not in REWARDS:
            raise ValueError(f"agent {self.name!r}: unknown reward {self.reward!r}; "
                             f"valid: {REWARDS}")
        if self.group_size < 2:
            raise ValueError(f"agent {self.name!r}: group_size={self.group_size} must be >= 2")


@dataclasses.dataclass(frozen=True)
class Edge:
    """``target`` sees ``source``'s output (trajectory ``trajectory`` of its group)."""

    source: str
    target: str
    trajectory: int = 0


@dataclasses.dataclass(frozen=True)
class Workflow:
    """Agents and their interaction; validated on construction (names, edges, acyclic)."""

    agents: tuple[AgentSpec, ...]
    edges: tuple[Edge, ...] = ()
    max_digits: int = 1

    def __post_init__(self):
        names = [a.name for a in self.agents]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"agent names must be non-empty and unique, got {names}")
        sources: dict[str, Edge] = {}
        for e in self.edges:
            for n in (e.source, e.target):
                if n not in names:
                    raise ValueError(f"edge {e} names unknown agent {n!r}; agents: {names}")
            if e.target in sources:
                raise ValueError(f"agent {e.target!r} has two upstream agents; one is supported")
            if not 0 <= e.trajectory < self.agent(e.source).group_size:
                raise ValueError(f"edge {e}: trajectory must be < the source's group_size")
            sources[e.target] = e
        self.order()  # raises on a cycle
        for a in self.agents:
            if a.name in sources and not hasattr(self.task(a.name), "from_upstream"):
                raise ValueError(f"agent {a.name!r} has an upstream agent but its reward "
                                 f"{a.reward!r} cannot build prompts from one")

    def agent(self, name: str) -> AgentSpec:
        """The spec of agent ``name``; KeyError names the agents."""
        for a in self.agents:
            if a.name == name:
                return a
        raise KeyError(f"unknown agent {name!r}; agents: {[a.name for a in self.agents]}")

    def upstream(self, name: str) -> Edge | None:
        """The edge into agent ``name``, or None for a first-turn agent."""
        return next((e for e in self.edges if e.target == name), None)

    def turn(self, name: str) -> int:
        """Agent ``name``'s turn: the length of its upstream chain (ValueError on a cycle)."""
        e = self.upstream(name)
        seen = {name}
        depth = 0
        while e is not None:
            if e.source in seen:
                raise ValueError(f"the edges form a cycle through {e.source!r}")
            seen.add(e.source)
            depth += 1
            e = self.upstream(e.source)
        return depth

    def order(self) -> tuple[str, ...]:
        """Agent names by turn (stable within a turn)."""
        return tuple(sorted((a.name for a in self.agents), key=self.turn))

    def task(self, name: str) -> Task:
        """The reward task of agent ``name``."""
        return make_reward_task(self.agent(name).reward, self.max_digits)


def solver_verifier_workflow(solver_model: TransformerConfig, verifier_model: TransformerConfig,
                             *, group_size: int = 4, max_digits: int = 1,
                             solver_tokens: int = 4, verifier_tokens: int = 2) -> Workflow:
    """The built-in two-agent workflow on addition (see module doc)."""
    return Workflow(
        agents=(AgentSpec("solver", solver_model, "solver", "addition", group_size,
                          solver_tokens),
                AgentSpec("verifier", verifier_model, "verifier", "verify_addition", group_size,
                          verifier_tokens)),
        edges=(Edge("solver", "verifier"),), max_digits=max_digits)
