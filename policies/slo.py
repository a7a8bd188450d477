"""Service-level objectives of a client class: the keys a class may set, the checks that relate them, and the
objective one request gets (its class's, or tighter through the `x-slo-ttft-ms` header).

A class promises a time to first token (`ttft_slo_ms`) and optionally a time per output token after it
(`tpot_slo_ms`); `on_slo_miss` says what a request predicted to miss its TTFT objective gets: "reject" (429
`slo_unattainable` at once), "degrade" (the next heavier tier's actions, then served) or "serve". A request may
ask for a tighter TTFT objective, never a looser one, and never below the class's `min_ttft_slo_ms`; its priority
is the class's whatever it asks (docs/policies.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from policies.validation import Strict

HEADER = "x-slo-ttft-ms"  # the request header that may tighten the class's TTFT objective
ON_SLO_MISS = ("reject", "degrade", "serve")


class ClassSloFields(Strict):
    """The objective keys of a [classes.NAME] table (policies/loader.py's ClassFile takes them)."""
    ttft_slo_ms: int = Field(0, ge=0)  # 0: no TTFT objective
    tpot_slo_ms: int = Field(0, ge=0)  # 0: no TPOT objective
    on_slo_miss: Literal[ON_SLO_MISS] = "serve"
    min_ttft_slo_ms: int = Field(0, ge=0)  # the tightest objective the header may ask for; 0: header not accepted


def slo_relations(classes: dict[str, ClassSloFields], num_tiers: int) -> Iterator[tuple[str, str]]:
    """(key path, message) for each objective key that contradicts another."""
    for name, spec in classes.items():
        where = f"classes.{name}"
        if spec.min_ttft_slo_ms and spec.ttft_slo_ms and spec.min_ttft_slo_ms > spec.ttft_slo_ms:
            yield (f"{where}.min_ttft_slo_ms", f"min_ttft_slo_ms {spec.min_ttft_slo_ms} is looser than the class's "
                                               f"ttft_slo_ms {spec.ttft_slo_ms}; a header may only tighten it")
        if spec.on_slo_miss != "serve" and not (spec.ttft_slo_ms or spec.min_ttft_slo_ms):
            yield (f"{where}.on_slo_miss", f"on_slo_miss = {spec.on_slo_miss!r} needs a ttft_slo_ms (or a "
                                           f"min_ttft_slo_ms for the {HEADER} header) to act on")
        if spec.on_slo_miss == "degrade" and not num_tiers:
            yield (f"{where}.on_slo_miss", "on_slo_miss = 'degrade' applies a tier's actions, and the file has no "
                                           "[[tiers]]; define one or choose 'reject' or 'serve'")


class ObjectiveError(ValueError):
    """A header that asks for an objective the class does not allow; the message names the header."""


def request_ttft_objective(class_name: str, ttft_slo_ms: int, min_ttft_slo_ms: int, header: str | None) -> int:
    """The TTFT objective (ms, 0: none) of one request of this class: the class's, or the header's when it is a
    whole number of milliseconds within [min_ttft_slo_ms, ttft_slo_ms] (no upper bound when the class has none)."""
    if header is None:
        return ttft_slo_ms
    text = header.strip()
    if not text.isdigit() or int(text) <= 0:
        raise ObjectiveError(f"{HEADER} must be a positive whole number of milliseconds, got {header[:40]!r}")
    asked = int(text)
    if not min_ttft_slo_ms:
        raise ObjectiveError(f"class {class_name!r} does not accept {HEADER} (its policy sets no min_ttft_slo_ms)")
    if asked < min_ttft_slo_ms:
        raise ObjectiveError(f"{HEADER} {asked} is tighter than class {class_name!r} allows (min_ttft_slo_ms "
                             f"{min_ttft_slo_ms})")
    if ttft_slo_ms and asked > ttft_slo_ms:
        raise ObjectiveError(f"{HEADER} {asked} would loosen class {class_name!r}'s objective of {ttft_slo_ms} ms; "
                             f"a request may only tighten it")
    return asked
