"""A client that gives up stops the server's work: the official openai client with a short
timeout (or a stream it closes) against grooves serve on 127.0.0.1, the server's own token
count read from ``/health``. Each request asks for far more tokens than can be made in the
time the test watches (ignore_eos), so a count that keeps rising means the work went on."""

import time

import httpx
import openai
import pytest

from grooves.serve.app import ServerThread, build_server, create_app

LONG = 1900  # tokens asked for: seconds of decoding for the tiny model on this CPU (400 took under 1 s quiet)
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = build_server("tiny", runs=tmp_path_factory.mktemp("runs"))
    with ServerThread(create_app(served)) as thread:
        yield served, thread.base_url
    served.engine.stop()


def health(server) -> dict:
    return httpx.get(server[1].removesuffix("/v1") + "/health", timeout=10).json()


def settled_count(server) -> tuple[int, int]:
    """The generated-token count just after the client left, and a second later."""
    time.sleep(0.5)  # the server notices, and the row leaves the batch at its next token
    first = health(server)["generated_tokens"]
    time.sleep(1.0)
    return first, health(server)["generated_tokens"]


def test_a_client_that_times_out_stops_a_non_streamed_completion(server):
    before = health(server)
    impatient = openai.OpenAI(base_url=server[1], api_key="unused", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="tiny", messages=HELLO, max_tokens=LONG,
                                          extra_body={"ignore_eos": True})
    first, later = settled_count(server)
    assert first == later  # nothing more was generated for a client that is gone
    assert 0 < later - before["generated_tokens"] < LONG
    assert health(server)["cancelled_requests"] == before["cancelled_requests"] + 1


def test_closing_a_stream_stops_its_generation(server):
    before = health(server)["generated_tokens"]
    client = openai.OpenAI(base_url=server[1], api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=LONG, stream=True,
                                            extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += len(chunk.choices)
        if received >= 3:
            break
    stream.close()
    first, later = settled_count(server)
    assert first == later
    assert 0 < later - before < LONG


def test_the_server_still_answers_after_clients_left(server):
    client = openai.OpenAI(base_url=server[1], api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"


def test_a_client_that_times_out_stops_a_legacy_completion(server):
    before = health(server)["generated_tokens"]
    impatient = openai.OpenAI(base_url=server[1], api_key="unused", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model="tiny", prompt=["one", "two"], max_tokens=LONG,
                                     extra_body={"ignore_eos": True})
    first, later = settled_count(server)
    assert first == later
    assert 0 < later - before < 2 * LONG


def test_a_request_whose_client_left_while_it_waited_in_the_queue_is_never_decoded(server):
    """B queues behind A's batch (one batch runs at a time); both clients give up. A stops at its
    next token, and B is dropped when its turn comes: no token is made for it."""
    import threading

    before = health(server)

    def ask(timeout: float) -> None:
        impatient = openai.OpenAI(base_url=server[1], api_key="unused", max_retries=0, timeout=timeout)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(model="tiny", messages=HELLO, max_tokens=LONG,
                                              extra_body={"ignore_eos": True})

    first = threading.Thread(target=ask, args=(1.0,))
    first.start()
    time.sleep(0.3)  # A's batch is running when B arrives
    ask(0.3)
    first.join()
    settled, later = settled_count(server)
    assert settled == later
    made = later - before["generated_tokens"]
    assert 0 < made < LONG  # A's tokens before it stopped, none for B
    after = health(server)
    assert after["cancelled_requests"] == before["cancelled_requests"] + 2
    assert after["batches"] == before["batches"] + 1  # only A's batch ran: B never reached the model
