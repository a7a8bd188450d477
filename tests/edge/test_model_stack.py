"""The pieces several models share (issue 45): every loaded engine told the best priority waiting for prefill across
all models (SharedPriority), and one /metrics page of every model's registry, each family once."""

from edge.core.metrics import Metrics
from edge.models.stack import SharedPriority


class Engine:
    def __init__(self) -> None:
        self.told: list[int | None] = []

    def prefill_priority_changed(self, priority: int | None) -> None:
        self.told.append(priority)


def test_every_engine_hears_the_best_priority_waiting_in_any_models_prefill():
    shared, a, b = SharedPriority(), Engine(), Engine()
    shared.attach("a", a)
    shared.attach("b", b)
    report_a, report_b = shared.reporter("a"), shared.reporter("b")
    report_a(10)  # a's low-priority prompts wait
    report_b(0)  # b's important one arrives: a's engine yields to it too
    report_b(None)  # b's prompt went to decode: back to a's own
    report_a(None)
    assert a.told == [None, 10, 0, 10, None] and b.told == [None, 10, 0, 10, None]
    shared.detach("b")
    report_a(3)
    assert a.told[-1] == 3 and b.told[-1] is None  # a detached engine hears nothing more


def test_one_metrics_page_holds_every_models_series_each_family_once():
    a, b, front = Metrics("a"), Metrics("b"), Metrics("")
    a.label(a.prompt_tokens).inc(5)
    b.label(b.prompt_tokens).inc(7)
    page = front.render(a, b).decode()
    assert page.count("# HELP vllm:prompt_tokens_total") + page.count("# HELP vllm:prompt_tokens ") == 1
    assert 'vllm:prompt_tokens_total{model_name="a"} 5.0' in page
    assert 'vllm:prompt_tokens_total{model_name="b"} 7.0' in page


def test_a_prompt_is_held_back_while_another_model_has_a_more_important_one():
    from types import SimpleNamespace
    shared = SharedPriority()
    pool_b = SimpleNamespace(num_ready=1)
    shared.attach("a", Engine())
    shared.attach("b", Engine(), pool_b)
    shared.reporter("b")(0)
    assert shared.outranked("a", 10) and not shared.outranked("a", 0)  # strictly more important only
    assert not shared.outranked("b", 10)  # its own prompts never hold it back
    pool_b.num_ready = 0  # b's workers are down: its queue holds no other model back
    assert not shared.outranked("a", 10)
    pool_b.num_ready = 1
    shared.reporter("b")(None)  # b's prompt went to decode
    assert not shared.outranked("a", 10)
