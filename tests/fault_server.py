"""A chat-completions server on 127.0.0.1 that answers from a script: the faults judges must survive.

Each request takes the next step of the script: ``("reply", text)``, ``("status", code)``,
``("status", 429, retry_after)``, ``("sleep", seconds, text)`` (answers late: a timeout for a
short client timeout), or a callable ``f(body) -> text`` that answers from the request. When
the script runs out, the last step repeats. Every request body is kept in ``requests``.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from grooves.serve.app import ServerThread


def completion(text: str) -> dict:
    return {"id": "chatcmpl-fault", "object": "chat.completion", "created": int(time.time()), "model": "fault",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


class FaultServer:
    def __init__(self):
        self.script: list = [("reply", "{}")]
        self.requests: list[dict] = []
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._handle)
        self._thread = ServerThread(self.app)

    def __enter__(self) -> FaultServer:
        self._thread.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._thread.__exit__(*exc)

    @property
    def base_url(self) -> str:
        return self._thread.base_url

    def play(self, *steps) -> None:
        self.script = list(steps)
        self.requests.clear()

    async def _handle(self, request: Request):
        body = await request.json()
        self.requests.append(body)
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if callable(step):
            return completion(step(body))
        kind = step[0]
        if kind == "reply":
            return completion(step[1])
        if kind == "sleep":
            await asyncio.sleep(step[1])
            return completion(step[2])
        headers = {"retry-after": str(step[2])} if len(step) > 2 else {}
        if step[1] == 400:
            message = step[2] if len(step) > 2 else "bad request"
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=400)
        return JSONResponse({"error": {"message": f"injected {step[1]}", "type": "server_error"}},
                            status_code=step[1], headers=headers)
