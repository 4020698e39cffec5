"""`veloxquant serve --kv-memory GB` (issue 32): requests are admitted while their caches
fit the budget (the method's measured bytes per token x (prompt + max_tokens)), queued
otherwise, and refused with HTTP 400 when they can never fit."""

import threading
import time

import pytest

import test_server_limits as limits
from veloxquant_mlx.cli import kv_memory_bytes
from veloxquant_mlx.integrations.mlx_lm import KVAdmission


def test_admission_refuses_what_never_fits_naming_budget_and_need():
    gate = KVAdmission(budget=1000, bytes_per_token=4.5, method="kivi")
    assert gate.need(10) == 45 and gate.need(3) == 14  # rounded up
    assert gate.refusal(100, 122) is None  # 222 x 4.5 = 999
    why = gate.refusal(100, 123)
    assert "needs 1004 bytes" in why and "--kv-memory budget of 1000 bytes" in why
    assert "4.5 bytes a token" in why and "'kivi'" in why and "at most 222 tokens" in why


def test_admission_queues_first_come_first_served_within_the_budget():
    gate = KVAdmission(budget=100, bytes_per_token=1.0, method="full")
    order, release = [], {name: threading.Event() for name in "abc"}

    def request(name, need):
        with gate.admitted(need):
            order.append((name, gate.in_use))
            release[name].wait(10)

    threads = {}
    for name, need in (("a", 60), ("b", 50), ("c", 30)):
        threads[name] = threading.Thread(target=request, args=(name, need))
        threads[name].start()
        time.sleep(0.2)
    # c would fit beside a, but b came first and does not: both wait
    assert order == [("a", 60)]
    release["a"].set()
    threads["a"].join(5)
    time.sleep(0.2)
    assert order == [("a", 60), ("b", 50), ("c", 80)]
    release["b"].set()
    release["c"].set()
    for t in threads.values():
        t.join(5)
    assert gate.in_use == 0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_kv_memory_must_be_a_positive_number_of_gb(bad):
    with pytest.raises(SystemExit) as info:
        kv_memory_bytes(bad)
    assert f"--kv-memory={bad}" in str(info.value) and "above 0" in str(info.value)
    assert kv_memory_bytes(1.5) == 1_500_000_000


def test_serve_kv_memory_queues_what_does_not_fit_now_and_refuses_what_never_fits(tmp_path):
    """The reference model's full cache holds 4,096 bytes a token: a 1.2 MB budget holds
    about 292 tokens, one 160-token request at a time."""
    server, port, log = limits._start(tmp_path, "--method", "full", "--kv-memory", "0.0012")
    try:
        status, reply = limits._post(port, {"prompt": "a" * 300, "max_tokens": 4}, timeout=20)
        assert status == 400, reply
        assert "--kv-memory budget of 1200000 bytes" in reply["error"], reply
        assert "4096.0 bytes a token" in reply["error"], reply
        replies = []

        def ask():
            replies.append(limits._post(port, {"prompt": "a" * 100, "max_tokens": 60,
                                               "temperature": 0.0}, timeout=120))

        both = [threading.Thread(target=ask) for _ in range(2)]
        for t in both:
            t.start()
        for t in both:
            t.join(150)
        assert [s for s, _ in replies] == [200, 200], replies
        assert replies[0][1]["choices"][0]["text"] == replies[1][1]["choices"][0]["text"]
    finally:
        output = limits._stop(server, log)
    assert "KV budget 1200000 bytes, 4096.0 bytes a token" in output, output
    assert "request queued" in output, output
    assert "Traceback" not in output, output
