"""The environment contract: ``reset(task) -> state``, the env's reply to an assistant turn,
``is_done(state)``, ``score(state) -> named components``.

An ``Env`` holds no per-rollout data; everything a rollout changes lives in its ``State``
(conversation, tokens, the rollout's own random generator, counters and the env's own
``data`` and ``resources`` such as a private database). Many rollouts of one env run at
once, so tools receive the state as their first argument.

Tools are typed methods marked with ``@tool``: the signature (after ``state``) and the
docstring become an OpenAI tool schema, and the same signature validates the model's
arguments (pydantic), so a wrong type is an error message back to the model, never an
exception in the rollout. Every bad input is answered and counted:

=====================  =========================================  ======================
model output           what the model gets back                   counter
=====================  =========================================  ======================
malformed call JSON    the parse error and the expected format    ``tool_errors/malformed``
unknown tool           the list of tools                          ``tool_errors/unknown_tool``
wrong or extra args    the field errors                           ``tool_errors/bad_arguments``
a tool that raises     the exception's type and message           ``tool_errors/raised``
an error as a result   the result as returned (``is_error``)      ``tool_errors/returned``
a tool that hangs      a timeout note (``tool_timeout_s``)        ``tool_errors/timeout``
an enormous result     the first ``max_result_chars`` and a note  ``tool_results/truncated``
=====================  =========================================  ======================

A tool whose function cannot take arguments that passed its schema is the env author's bug,
not the model's: it is counted apart (``tool_errors/env_bug``), the model is told the
environment failed, and ``state.data["env_bugs"]`` keeps the error for ``grooves env try``.

A single-turn task is the trivial case: an env with no tools whose first reply is final.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from grooves.envs.state import State, TokenLog, stored_data
from grooves.envs.tools import BadArguments, Tool, call_text, make_tool, tool  # noqa: F401 (the env API)
from grooves.policy.tools import ToolCall, parse_tool_calls
from grooves.types import Message, Task


SNAPSHOT_MAGIC = b"grooves-env-snapshot/1\n"

TOOL_THREADS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="grooves-tool")
"""Where tools run. Not an event loop's default executor: closing a loop waits for that one,
so a tool that hangs past its timeout would hold up the whole round."""


class Env:
    """Base of every environment. Subclasses set ``name`` and implement ``tasks``, ``score`` and
    usually ``setup`` (per-rollout data); tools are ``@tool`` methods."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    system_prompt: ClassVar[str | None] = None
    weights: ClassVar[dict[str, float]] = {}  # score component -> weight in the total
    success: ClassVar[str] = ""  # the score that says the task was solved (benchmarks' success rate)
    max_turns: int = 8
    max_tokens: int = 512  # generated tokens per rollout, all turns together
    user: Any = None  # the user's side after a text turn (grooves.envs.users); None: a text turn is the answer
    # Prompt tokens (system, tools, task) this env's tasks may need; a run whose
    # sampling.max_prompt_length is smaller stops at start-up instead of skipping them.
    prompt_budget: ClassVar[int | None] = None
    tool_timeout_s: float = 5.0
    max_result_chars: int = 2000
    # JSON characters of ``state.data`` a stored trajectory keeps; larger values become a digest.
    # Large per-rollout state belongs in ``state.resources`` (``save_resources``/``load_resources``).
    stored_data_chars: int = 4000
    parser: str = "auto"

    def __init__(self, **options: Any):
        for key, value in options.items():
            if key not in self.option_names():
                raise ValueError(f"{self.name}: unknown option {key!r}; allowed: {', '.join(self.option_names())}")
            setattr(self, key, value)

    @classmethod
    def option_names(cls) -> list[str]:
        """Settings a config's ``[env] options`` may change: plain public class values (numbers,
        strings, flags, tuples of those), not the env's identity (``name``, ``weights``, ...), nothing declared
        ``ClassVar`` (``success``, ``system_prompt``: what the env is, not how it runs) and no method."""
        fixed = {"name", "description", "weights", "schema"}
        for klass in cls.__mro__:
            fixed |= {key for key, hint in vars(klass).get("__annotations__", {}).items()
                      if str(hint).startswith(("ClassVar", "typing.ClassVar"))}
        names = set()
        for klass in cls.__mro__:
            for key, value in vars(klass).items():
                plain = isinstance(value, (int, float, str, bool)) or (
                    isinstance(value, tuple) and all(isinstance(v, (int, float, str, bool)) for v in value))
                if not key.startswith("_") and key not in fixed and plain and not isinstance(value, type):
                    names.add(key)
        return sorted(names)

    # --- what subclasses provide --------------------------------------------------

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        """Tasks with everything ``score`` needs (expected outcomes); ``split`` is train or heldout.
        With ``n`` None, every task of the split (``env replay --task`` looks an id up among them);
        otherwise ``n`` of them, chosen and ordered by ``seed``."""
        raise NotImplementedError

    def setup(self, state: State) -> None:
        """Fill ``state.data`` / ``state.resources`` for a fresh rollout (e.g. a private database)."""

    def score(self, state: State) -> dict[str, float]:
        """Named reward components of a finished rollout (each usually in [0, 1])."""
        raise NotImplementedError

    def close(self, state: State) -> None:
        """Release ``state.resources``."""

    def stored_data(self, state: State) -> dict[str, Any]:
        """What a trajectory keeps of ``state.data`` for training, review and reward functions (it is
        stored with every trajectory of a run): by default all of it up to ``stored_data_chars`` of
        JSON, the largest values beyond that as a digest (``grooves.envs.state.stored_data``)."""
        return stored_data(state.data, self.stored_data_chars)

    def demonstrate(self, task: Task) -> list[str] | None:
        """An expert's assistant turns for ``task``, written as the model should write them (tool
        calls in the rendering's own format, ``call_text``); None when there is none for this task.
        ``grooves.envs.replay.demonstrations`` replays them and keeps those that score in full."""
        raise NotImplementedError(f"env {self.name!r} has no demonstrations")

    def solved(self, scores: dict[str, float]) -> bool:
        """Whether a rollout with these scores solved its task: its ``success`` score is 1
        (without one: every score is 1)."""
        keys = [self.success] if self.success else list(scores)
        return all(scores[k] >= 1.0 - 1e-9 for k in keys)

    # --- the contract --------------------------------------------------------------

    def extra_tools(self) -> list[Tool]:
        """Tools that are not ``@tool`` methods, e.g. ``Tool.from_schema`` over a benchmark's schemas."""
        return []

    @functools.cached_property
    def tool_list(self) -> list[Tool]:
        tools = []
        for attr in dir(type(self)):
            fn = getattr(type(self), attr, None)
            if callable(fn) and hasattr(fn, "__grooves_tool__"):
                tools.append(make_tool(getattr(self, attr), fn.__grooves_tool__))
        tools += self.extra_tools()
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"env {self.name!r} has two tools of one name: {sorted(names)}")
        return tools

    @functools.cached_property
    def tools_by_name(self) -> dict[str, Tool]:
        return {t.name: t for t in self.tool_list}

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tool_list]

    def prompt(self, task: Task) -> list[Message]:
        """The conversation a rollout starts from."""
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        prompt = task["prompt"]
        return messages + (list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}])

    def reset(self, task: Task, seed: int = 0) -> State:
        # Seeded by the task, not the sample: the G rollouts of a group face the same world.
        state = State(task=task, messages=self.prompt(task), rng=random.Random(f"{seed}:{task.get('id')}"))
        self.setup(state)
        return state

    def is_done(self, state: State) -> bool:
        return state.done

    async def respond(self, state: State, text: str) -> list[Message]:
        """Take the model's turn ``text``: record it, run its tool calls (in worker threads, with a
        timeout each) and return the env's messages. A turn without tool calls is the answer, unless
        the env's user (``user_turn``) replies to it."""
        reply = parse_tool_calls(text, self.parser)
        state.turns += 1
        for index, call in enumerate(reply.tool_calls):  # ids from the position: a replay gives the same ids
            call.id = f"call_{state.turns}_{index}"
        message: Message = {"role": "assistant", "content": reply.content, "raw": text}
        if reply.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in reply.tool_calls]
        state.messages.append(message)
        out: list[Message] = []
        if reply.repaired:
            state.counters["tool_calls/repaired"] += reply.repaired
        for error in reply.errors:
            state.counters["tool_errors/malformed"] += 1
            out.append(self._error_message(None, f"{error}. Write a call as <tool_call>{{\"name\": "
                                                 f"\"TOOL\", \"arguments\": {{...}}}}</tool_call>."))
        for call in reply.tool_calls:
            out.append(await self._run(state, call))
            if state.done:
                break
        if not reply.tool_calls and not reply.errors:
            follow = await self.user_turn(state, reply.content)
            if follow is None:
                self.finish(state, reply.content, "answer")
            else:
                state.counters["user_turns"] += 1
                out.append({"role": "user", "content": follow})
        state.messages += out
        return out

    async def user_turn(self, state: State, text: str) -> str | None:
        """After an assistant turn without tool calls: the user's next message, or None to end the
        rollout with ``text`` as the answer. Asks ``self.user`` (``grooves.envs.users``) when set."""
        return None if self.user is None else await self.user(state, text)

    def finish(self, state: State, answer: str | None, reason: str) -> None:
        """End the rollout (an answer tool calls this with the model's answer)."""
        state.done, state.finish = True, reason
        if answer is not None:
            state.answer = answer

    # --- snapshot and restore ---------------------------------------------------------

    def snapshot(self, state: State) -> bytes:
        """The whole rollout at this point: conversation, tokens, counters, env data, the rollout's
        random generator and (through ``save_resources``) its live resources such as the database."""
        version, internal, gauss = state.rng.getstate()
        blobs = self.save_resources(state)
        header = {"task": state.task, "messages": state.messages, "rng": [version, list(internal), gauss],
                  "tokens": vars(state.tokens), "data": state.data, "counters": dict(state.counters),
                  "turns": state.turns, "done": state.done, "answer": state.answer, "finish": state.finish,
                  "env": self.name, "blobs": {name: len(blob) for name, blob in blobs.items()}}
        return SNAPSHOT_MAGIC + json.dumps(header).encode() + b"\n" + b"".join(blobs.values())

    def restore(self, snapshot: bytes) -> State:
        """A live state from ``snapshot(state)``: continuing it gives what continuing the original would."""
        if not snapshot.startswith(SNAPSHOT_MAGIC):
            raise ValueError("not a grooves env snapshot")
        body = snapshot[len(SNAPSHOT_MAGIC):]
        head, _, rest = body.partition(b"\n")
        header = json.loads(head)
        if header["env"] != self.name:
            raise ValueError(f"a snapshot of env {header['env']!r} cannot be restored by {self.name!r}")
        version, internal, gauss = header["rng"]
        rng = random.Random()
        rng.setstate((version, tuple(internal), gauss))
        state = State(task=header["task"], messages=header["messages"], rng=rng, tokens=TokenLog(**header["tokens"]),
                      data=header["data"], counters=Counter(header["counters"]), turns=header["turns"],
                      done=header["done"], answer=header["answer"], finish=header["finish"])
        blobs, offset = {}, 0
        for name, length in header["blobs"].items():
            blobs[name] = rest[offset: offset + length]
            offset += length
        self.load_resources(state, blobs)
        return state

    def save_resources(self, state: State) -> dict[str, bytes]:
        """Live resources as bytes, for ``snapshot``."""
        return {}

    def load_resources(self, state: State, blobs: dict[str, bytes]) -> None:
        """Rebuild ``state.resources`` from ``save_resources``' bytes."""

    # --- tools ------------------------------------------------------------------------

    async def _run(self, state: State, call: ToolCall) -> Message:
        tools = self.tools_by_name
        state.counters["tool_calls"] += 1
        state.counters[f"tool_calls/{call.name}" if call.name in tools else "tool_calls/unknown"] += 1
        found = tools.get(call.name)
        if found is None:
            state.counters["tool_errors/unknown_tool"] += 1
            return self._error_message(call, f"unknown tool {call.name!r}; the tools are: {', '.join(tools)}")
        try:
            invoke = found.bind(state, found.validate(call.arguments))
        except BadArguments as error:
            state.counters["tool_errors/bad_arguments"] += 1
            return self._error_message(call, f"invalid arguments for {call.name}: {error}")
        except TypeError as error:  # valid arguments the env's own function cannot take
            state.counters["tool_errors/env_bug"] += 1
            state.data.setdefault("env_bugs", []).append(f"{call.name}: {error}")
            return self._error_message(call, f"{call.name} could not run (an error in the environment, "
                                             f"not in your call)")
        try:
            running = asyncio.get_running_loop().run_in_executor(TOOL_THREADS, invoke)
            result = await asyncio.wait_for(running, self.tool_timeout_s)
        except TimeoutError:
            state.counters["tool_errors/timeout"] += 1
            self.interrupt(state)
            return self._error_message(call, f"{call.name} did not finish within {self.tool_timeout_s:g} s")
        except Exception as error:  # a tool's failure is the model's information, not a crash
            state.counters["tool_errors/raised"] += 1
            return self._error_message(call, f"{call.name} failed: {type(error).__name__}: {error}")
        if self._returned_error(state, found, result):
            state.counters["tool_errors/returned"] += 1
        return self._tool_message(state, call, result)

    def _returned_error(self, state: State, found: Tool, result: Any) -> bool:
        """Whether the tool's ``is_error`` reads ``result`` as a failure; a rule that raises is the env's bug."""
        if found.is_error is None:
            return False
        try:
            return bool(found.is_error(result))
        except Exception as error:
            state.counters["tool_errors/env_bug"] += 1
            state.data.setdefault("env_bugs", []).append(f"{found.name}: is_error: {type(error).__name__}: {error}")
            return False

    def interrupt(self, state: State) -> None:
        """Stop a tool call that timed out (a SQLite env interrupts its query)."""

    def _tool_message(self, state: State, call: ToolCall, result: Any) -> Message:
        text = result if isinstance(result, str) else json.dumps(result, default=str)
        if len(text) > self.max_result_chars:
            state.counters["tool_results/truncated"] += 1
            text = (text[: self.max_result_chars] + f"\n[truncated: {len(text) - self.max_result_chars} more "
                    f"characters not shown; ask for less]")
        return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text}

    def _error_message(self, call: ToolCall | None, text: str) -> Message:
        message = {"role": "tool", "content": f"error: {text}", "name": call.name if call else "error"}
        if call is not None:
            message["tool_call_id"] = call.id
        return message

