"""One memory budget per box, planned before anything loads (DESIGN.md, "Memory is the budget").

From a model's sizes (contracts/model_sizes.py, read from its GGUF header), the machine's memory and the serve
config, the plan decides what each process may hold, and refuses a model that cannot fit (MemoryRefused, each
part's bytes and the budget named). Pure Python: `edge serve` plans before it starts a process, `edge check-model
--memory` prints the same plan.

Required, in this order: the decode weights (one set), each process's runtime, the swap space, the answers' KV on
its way back to the workers (kv_return_bytes, host memory: a bounded queue of copies), the prefill workers
with the given GGUF (fewer workers if they do not fit, at least one) and the KV pool's floor. Then, each only where
it fits beside everything before it: the prefill workers' copy of the weights (f16, else q8_0; mmap'd by llama.cpp,
so every worker shares one copy; 1.85x prefill on the embedded model, 330 against 178 tok/s), then the decode
model's float set beside its quantized one (weight_dtype auto on a CPU: quantized for small batches, float for
large ones). The KV pool takes what is left, up to every sequence at its longest (more would sit unused).

Runtimes are measured (docs/sizes.md, bench/process_memory.py): what an idle process holds beyond its weights,
caches and buffers, on the embedded model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts.model_sizes import FLOAT_BYTES, GGUF_EXACT_INT4, ModelSizes, copy_may_pay, engine_repacks, worker_repacks
from contracts.prompt_cache import FLOOR_TOKENS, prompt_cache_tokens

MIB, GIB = 2**20, 2**30
CPU_SHARE, CUDA_SHARE = 0.85, 0.90  # the default budget: this share of the RAM (CPU) or of the device's memory (CUDA)
# An idle process's RSS beyond its weights, KV and llama.cpp's buffers after start-up (docs/sizes.md,
# bench/process_memory.py). Embedded model: a worker 456 MiB beyond its mapped f16 copy, less its KV (135 MiB) and
# compute buffer (49 MiB): 272 (Python, llama-cpp-python, the vocabulary for grammars, what its start-up probe's
# freed models left in the allocator; 1B ladder: 247); the CPU engine 942 MiB less its weights (347): 595 (libraries
# 302 before the model loaded, then the tokenizer, grammar tables, warm-up activations, allocator slack; 1B ladder:
# 725, of which a step's activations grow with the vocabulary); the gateway 78 MiB and its two grammar compile
# processes, 124 MiB each (1B ladder)
WORKER_RUNTIME = 280 * MIB
ENGINE_RUNTIME = 600 * MIB
GATEWAY_RUNTIME = 350 * MIB
CUDA_CONTEXT = 600 * MIB  # on the device: the CUDA context, cuBLAS workspaces (not measured here: no GPU)
KV_FLOOR_TOKENS = 8192  # the pool's floor: this, or 4 x max_model_len if more (never above every sequence's longest)
GGUF_INT8 = {"Q8_0", "Q8_1", "Q8_K"}  # weight_dtype auto on CUDA follows the GGUF (decode_gpu/model/weight_plan.py)
GGUF_INT4 = {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
COPIES = ("f16", "q8_0")  # prefill_weights auto's copies, best first
# the matrix types the engine multiplies where they lie in the mapped GGUF (weight_dtype gguf,
# decode_gpu/model/gguf_layers.py GGUF_LAYER_TYPES: contracts imports nothing of decode_gpu)
GGUF_IN_PLACE = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                           "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"})
MAPPED = "the GGUF's own blocks, mapped"


class MemoryRefused(ValueError):
    """The model cannot be served within the budget, even with one weight set, one worker and the KV floor."""


@dataclass(frozen=True)
class Machine:
    device: str  # where the decode engine runs: "cpu" or "cuda"
    host_bytes: int  # the RAM
    device_bytes: int = 0  # the GPU's memory (cuda)
    cpu_flags: frozenset[str] = frozenset()  # whether the workers repack the GGUF's matrices (worker_repacks)


@dataclass(frozen=True)
class PlanConfig:
    """The serve settings the plan reads (keys of the same names, docs/config.md), with auto values resolved where
    the gateway resolves them (dtype, kv_type)."""
    memory_budget: int = 0  # bytes where the engine runs; 0: CPU_SHARE of the RAM, CUDA_SHARE of the device's
    weight_dtype: str = "auto"
    dtype: str = "bfloat16"  # the decode compute dtype
    prefill_weights: str = "auto"
    kv_type: str = "f16"  # the workers' llama.cpp cache and handoff type
    kv_storage: str = "auto"  # the pool's; auto: the compute dtype
    kv_cache_tokens: int = 0  # 0: the plan sizes the pool
    prefill_workers: int = 1
    n_ctx: int = 4096
    n_batch: int = 256
    prefix_cache_tokens: int = 8192  # the knob's default (contracts/options.py); the worker bounds it by RAM
    max_num_seqs: int = 32
    max_model_len: int = 4096
    swap_space_gib: float = 4.0
    kv_return_bytes: int = 64 * MIB  # finished answers' KV copied out by the engine, waiting to go back (at most)


@dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    where: str  # "host" or "device"
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    budgets: dict[str, int]  # where -> bytes
    parts: tuple[Part, ...]
    weight_dtype: str  # what the engine is told: a weight_dtype value (auto: it measures within second_set)
    second_set: bool  # the float set for large batches may be held beside the quantized one
    float_set: bool  # a float set fits (auto may keep float weights alone where they measure faster)
    prefill_copy: str | None  # the copy the workers may load (f16, q8_0); None: the given file only
    prefill_workers: int
    kv_cache_tokens: int
    swap_bytes: int  # the engine's swap space (swap_space_gib, capped at the pool floor's bytes)
    reasons: dict[str, str] = field(default_factory=dict)  # decision -> why
    repack: bool = False  # the engine repacks the mapped GGUF's matrices into memory of its own (weight_repack)
    prefix_cache_tokens: int = 0  # each worker's RAM prompt cache, as planned (the workers are told it)

    def used(self, where: str) -> int:
        return sum(p.bytes for p in self.parts if p.where == where)

    @property
    def prefill_copy_kinds(self) -> tuple[str, ...]:
        """The copies a worker's auto may measure (prefill_weights.prefill_weights_path's copy_kinds), best first: the
        planned one and the smaller q8_0 beside an f16."""
        return COPIES[COPIES.index(self.prefill_copy):] if self.prefill_copy in COPIES else ()

    def part_bytes(self) -> dict[str, int]:
        return {p.name: p.bytes for p in self.parts}

    def describe(self) -> str:
        """The table `edge check-model --memory` prints: each part, the totals against the budgets, the decisions."""
        lines = [f"{'part':40} {'where':6} {'MiB':>10}  note"]
        lines += [f"{p.name:40} {p.where:6} {p.bytes / MIB:10.1f}  {p.note}" for p in self.parts]
        for where, budget in self.budgets.items():
            used = self.used(where)
            share = used / budget
            lines.append(f"{'total':40} {where:6} {used / MIB:10.1f}  of the {budget / MIB:.1f} MiB budget "
                         f"({share:.0%}; {(budget - used) / MIB:.1f} MiB unplanned)")
        return "\n".join([*lines, "", *(f"{name}: {why}" for name, why in self.reasons.items())])


def default_budgets(machine: Machine, memory_budget: int = 0) -> dict[str, int]:
    """where -> bytes: where the engine runs, memory_budget or a share of it; on CUDA the host's too."""
    if machine.device == "cuda":
        return {"device": memory_budget or int(CUDA_SHARE * machine.device_bytes),
                "host": int(CPU_SHARE * machine.host_bytes)}
    return {"host": memory_budget or int(CPU_SHARE * machine.host_bytes)}


def plan_memory(sizes: ModelSizes, machine: Machine, config: PlanConfig) -> MemoryPlan:
    """The plan (module docstring); MemoryRefused when the required parts exceed a budget."""
    return _Planner(sizes, machine, config).plan()


@dataclass(frozen=True)
class WeightOption:
    """A way to hold the decode weights: the weight_dtype the engine is told, the sets it may hold (name, bytes)."""
    told: str
    sets: tuple[tuple[str, int], ...]
    second_set: bool  # quantized and float sets both
    float_set: bool  # auto may keep float weights (alone or beside the quantized)
    why: str
    repack: bool = False  # the mapped blocks repacked by llama.cpp's CPU repack, a copy in the engine's memory

    @property
    def bytes(self) -> int:
        return sum(held for _, held in self.sets)

    def parts(self, where: str) -> list[Part]:
        notes = ["", "for the batches the quantized kernels lose at",
                 "a first start only: auto measures every quantized kind beside the float set, then keeps one"]
        if self.repack:
            notes[1] = "llama.cpp's interleaved layout, faster decode kernels: the engine's own memory"
        return [Part(f"decode weights, {name}", held, where, note) for (name, held), note in zip(self.sets, notes)]


def weight_options(sizes: ModelSizes, device: str, weight_dtype: str, dtype: str,
                   flags: frozenset[str] = frozenset()) -> list[WeightOption]:
    """Best first; the last is the least the config allows. auto on a CPU measures int4 (every layer matrix affine
    4-bit) or int8, and ggml's q8_0, against the float weights (decode_gpu/model/weight_plan.py): room for the
    larger of the quantized ones until only the smaller fits. The GGUF's own blocks, mapped, are repacked for the
    engine where that fits too (an x86 CPU with AVX2, `flags`): a private copy in llama.cpp's faster layout."""
    in_place = device == "cpu" and bool(sizes.layer_types) and sizes.layer_types | {sizes.head_type} <= GGUF_IN_PLACE
    repackable = sizes.engine_repacked_bytes if device == "cpu" and engine_repacks(flags) else 0
    repacked = (f"{MAPPED}, repacked", repackable)
    if weight_dtype == "gguf":
        mapped = [WeightOption("gguf", ((MAPPED, sizes.file_bytes),), False, False, "one set (weight_dtype = 'gguf')")]
        return [WeightOption("gguf", ((MAPPED, sizes.file_bytes), repacked), False, False,
                             "one set (weight_dtype = 'gguf'), its matrices repacked (room for the copy)", True),
                *mapped] if repackable else mapped
    if weight_dtype != "auto" or device == "cuda":
        told = weight_dtype
        if weight_dtype == "auto":  # CUDA: the GGUF's own quantization
            told = "int4" if sizes.layer_types & GGUF_INT4 else "int8" if sizes.layer_types & GGUF_INT8 else dtype
        why = f"weight_dtype = {weight_dtype!r}" + (f": {told}, the GGUF's own" if weight_dtype == "auto" else "")
        held = sizes.decode_weight_bytes(told, dtype)
        return [WeightOption(weight_dtype, ((told, held),), False, told in FLOAT_BYTES, f"one set ({why})")]
    kind = "int4" if sizes.layer_types and sizes.layer_types <= GGUF_EXACT_INT4 else "int8"
    least, q8_0 = sizes.decode_weight_bytes(kind, dtype), sizes.decode_weight_bytes("q8_0", dtype)
    most, floating = max(least, q8_0), sizes.decode_weight_bytes(dtype, dtype)
    quantized = f"{kind} or q8_0" if q8_0 > least else kind
    # auto's first start builds every kind it measures beside the float set (a recorded plan skips it): the
    # smaller kind is held beside the larger until the plan is made
    measured = ((f"{kind}, while auto measures", least),) if q8_0 > least else ()
    both = WeightOption("auto", ((quantized, most), (dtype, floating), *measured), True, True,
                        f"auto: the {quantized} and {dtype} sets both fit (or {MAPPED}, where they measure as fast)")
    if in_place:  # one set: the file's pages, which the workers map too: nothing smaller can be held
        mapped = WeightOption("auto", ((MAPPED, sizes.file_bytes),), False, False,
                              f"auto, one set: both do not fit; {MAPPED} (no second copy)")
        if not repackable:
            return [both, mapped]
        # repacked first: llama.cpp's own decode kernels on a copy smaller than either set, no conversion at start.
        # On the 3B both sets took 11.3 GiB PSS against llama-server's 5.5 and 86 s to a cached start; repacked,
        # 4.9 GiB and 10.6 s, its products within 1.1-1.25x llama.cpp's whole step (docs/sizes.md)
        return [WeightOption("auto", ((MAPPED, sizes.file_bytes), repacked), False, False,
                             f"auto, one set: {MAPPED}, its matrices repacked for decode (llama.cpp's layout, the "
                             f"engine's own copy)", True), mapped]
    options = [both,
               WeightOption("auto", ((f"{quantized} or {dtype}", floating),), False, True,
                            "auto, one set: both do not fit; it keeps the one faster at one row"),
               WeightOption("auto", ((quantized, most),), False, False,
                            f"auto, quantized only: {dtype} ({floating / GIB:.2f} GiB) does not fit")]
    if most > least:
        options.append(WeightOption(kind, ((kind, least),), False, False,
                                    f"{kind} only: q8_0 ({q8_0 / GIB:.2f} GiB) and {dtype} do not fit"))
    return options


class _Planner:
    def __init__(self, sizes: ModelSizes, machine: Machine, config: PlanConfig) -> None:
        self.sizes, self.machine, self.config = sizes, machine, config
        self.budgets = default_budgets(machine, config.memory_budget)
        self.engine_at = "device" if machine.device == "cuda" else "host"
        storage = config.dtype if config.kv_storage == "auto" else config.kv_storage
        self.pool_storage, self.per_token = storage, sizes.pool_kv_bytes(storage)
        longest = config.max_num_seqs * config.max_model_len  # every sequence at its longest: more sits unused
        self.kv_cap = config.kv_cache_tokens or longest
        self.kv_floor = config.kv_cache_tokens or min(max(KV_FLOOR_TOKENS, 4 * config.max_model_len), longest)
        # swapped-out KV beyond what the pool's floor holds would be memory a CPU box pays twice for
        self.swap_bytes = min(int(config.swap_space_gib * GIB), self.kv_floor * self.per_token)
        self.options = weight_options(sizes, machine.device, config.weight_dtype, config.dtype, machine.cpu_flags)
        # each worker's prompt cache as the worker sizes it (prefix_cache_tokens within a share of the RAM,
        # contracts.prompt_cache); _workers_and_cache may shrink it before the model is refused
        self.cache_tokens = prompt_cache_tokens(config.prefix_cache_tokens, machine.host_bytes,
                                                sizes.handoff_kv_bytes(config.kv_type))
        self.reasons: dict[str, str] = {}

    def plan(self) -> MemoryPlan:
        least = self.options[-1]
        workers = self._workers_and_cache(least)
        copy = self._prefill_copy(least, workers)
        weights = next(o for o in self.options if o is least or self._fits(self._required(o, workers, copy)))
        self.reasons["weights"] = weights.why
        parts = self._required(weights, workers, copy)
        tokens = min(self.kv_cap, self.kv_floor + self._left(parts) // self.per_token)
        parts[-1] = self._kv_part(tokens)
        capped = tokens == self.kv_cap and not self.config.kv_cache_tokens
        self.reasons["kv_cache_tokens"] = (f"{tokens}: " + ("kv_cache_tokens" if self.config.kv_cache_tokens else
                                           "what is left") + (", up to every sequence at its longest (max_num_seqs "
                                                              "x max_model_len)" if capped else ""))
        return MemoryPlan(self.budgets, tuple(parts), weights.told, weights.second_set, weights.float_set, copy,
                          workers, tokens, self.swap_bytes, dict(self.reasons), weights.repack, self.cache_tokens)

    def _required(self, weights: WeightOption, workers: int, copy: str | None) -> list[Part]:
        config, sizes = self.config, self.sizes
        rows = config.max_num_seqs  # a step's logits, probabilities and sampling scratch, and its activations
        activations = rows * 4 * (8 * sizes.n_vocab + 4 * sizes.n_ff + 8 * sizes.n_embd)
        kv_cells = config.n_ctx + self.cache_tokens
        given, on_device = copy is None, self.engine_at == "device"
        # llama.cpp repacks the given file's Q4_K etc., unless the worker loads it without (worker_repacks)
        repacked = sizes.repacked_bytes if given and worker_repacks(sizes.layer_types, self.machine.cpu_flags) else 0
        worker_each = (WORKER_RUNTIME + kv_cells * sizes.handoff_kv_bytes(config.kv_type) + self._compute_buffer()
                       + repacked)
        held = weights.parts(self.engine_at)
        if given and weights.sets[0][0] == MAPPED:  # the same pages as the workers' mapping: counted there, once
            held[0] = Part(f"decode weights, {MAPPED}", 0, self.engine_at,
                           "the given GGUF's pages, shared with the workers (counted under prefill weights)")
        parts = [*held,
                 Part("engine runtime", ENGINE_RUNTIME + (0 if on_device else activations), "host",
                      "Python, torch, tokenizer" + ("" if on_device else ", a step's activations")),
                 Part("swap space (at most)", self.swap_bytes, "host",
                      "preempted sequences' KV: swap_space_gib or the pool's floor, the lesser"),
                 Part("answers' KV going back (at most)", config.kv_return_bytes, "host",
                      "finished answers' blocks copied out for their worker's prompt cache: kv_return_bytes"),
                 Part("gateway runtime", GATEWAY_RUNTIME, "host", "and its grammar compile processes"),
                 Part(f"prefill weights, {'the given GGUF' if given else copy + ' copy'}",
                      sizes.file_bytes if given else sizes.copy_bytes(copy), "host", "mmap'd: shared by the workers"),
                 Part(f"prefill workers x{workers}", workers * worker_each, "host",
                      f"each: runtime, llama.cpp KV of {kv_cells} tokens ({config.kv_type}), compute buffer"
                      + (", repacked matrices" if repacked else ""))]
        if on_device:
            parts.insert(len(weights.sets), Part("CUDA context, activations", CUDA_CONTEXT + activations, "device"))
        return [*parts, self._kv_part(self.kv_floor)]

    def _kv_part(self, tokens: int) -> Part:
        return Part(f"decode KV pool, {tokens} tokens", tokens * self.per_token, self.engine_at,
                    f"{self.pool_storage}, {self.per_token / 1024:.1f} KiB a token")

    def _compute_buffer(self) -> int:
        """llama.cpp's compute buffer at n_batch (flash attention): a batch's f32 logits and two hidden rows, as it
        reported for the embedded model (49.13 MiB) and the 1B ladder (129.25 MiB) at n_batch 256, plus its output
        buffer."""
        sizes = self.sizes
        return self.config.n_batch * 4 * (sizes.n_vocab + 2 * sizes.n_embd) + MIB

    def _left(self, parts: list[Part]) -> int:
        """What the pool's budget has left after `parts`."""
        return self.budgets[self.engine_at] - self._used(parts, self.engine_at)

    @staticmethod
    def _used(parts: list[Part], where: str) -> int:
        return sum(p.bytes for p in parts if p.where == where)

    def _fits(self, parts: list[Part]) -> bool:
        return all(self._used(parts, where) <= budget for where, budget in self.budgets.items())

    def _workers_and_cache(self, weights: WeightOption) -> int:
        """The workers that fit (_workers), with the worker's prompt cache as the worker sizes it (self.cache_tokens),
        or, where one worker does not fit with it, with the smaller cache of the earlier default (FLOOR_TOKENS)
        before the model is refused."""
        sized = self.cache_tokens
        self.reasons["prefix_cache_tokens"] = f"{sized} a worker"
        if sized > FLOOR_TOKENS:
            try:
                return self._workers(weights)
            except MemoryRefused:
                self.cache_tokens = FLOOR_TOKENS
                self.reasons["prefix_cache_tokens"] = (f"{FLOOR_TOKENS} a worker: {sized} (prefix_cache_tokens "
                                                       f"within its RAM share) would not fit")
        return self._workers(weights)

    def _workers(self, weights: WeightOption) -> int:
        wanted = self.config.prefill_workers
        for workers in range(wanted, 0, -1):
            if self._fits(self._required(weights, workers, self._named_copy())):
                if workers < wanted:
                    self.reasons["prefill_workers"] = f"{workers} of the {wanted} configured: one more would not fit"
                return workers
        raise MemoryRefused(self._refusal(self._required(weights, 1, self._named_copy())))

    def _named_copy(self) -> str | None:
        """A copy the config asks for by name (required then), else None."""
        wanted = self.config.prefill_weights
        return None if wanted in ("auto", "given") else wanted

    def _prefill_copy(self, weights: WeightOption, workers: int) -> str | None:
        wanted, sizes = self.config.prefill_weights, self.sizes
        if wanted != "auto":
            self.reasons["prefill_copy"] = f"prefill_weights = {wanted!r}"
            return self._named_copy()
        if sizes.unconverted:
            self.reasons["prefill_copy"] = "none: the GGUF has 16 or 32 bits a weight already"
            return None
        if not copy_may_pay(sizes.layer_types, self.machine.cpu_flags):
            self.reasons["prefill_copy"] = ("none: on this AVX-512 CPU llama.cpp prefills these K-quant matrices as "
                                            "given faster than from a copy (contracts.model_sizes.copy_may_pay)")
            return None
        for kind in COPIES:
            if self._fits(self._required(weights, workers, kind)):
                self.reasons["prefill_copy"] = (f"{kind} allowed ({sizes.copy_bytes(kind) / GIB:.2f} GiB, mmap'd by "
                                                f"every worker); auto keeps it if it prefills faster")
                return kind
        self.reasons["prefill_copy"] = (f"none: an f16 copy ({sizes.copy_bytes('f16') / GIB:.2f} GiB) or q8_0 would "
                                        f"not fit beside the required parts")
        return None

    def _refusal(self, parts: list[Part]) -> str:
        listed = "; ".join(f"{p.name} {p.bytes / MIB:.0f} MiB ({p.where})" for p in parts)
        budgets = ", ".join(f"{where} {budget / MIB:.0f} MiB, {self._used(parts, where) / MIB:.0f} MiB asked"
                            for where, budget in self.budgets.items())
        return (f"{self.sizes.name} does not fit the memory budget even with one weight set, one prefill worker "
                f"and a KV pool of {self.kv_floor} tokens: {listed}; budget {budgets}. Raise memory_budget, or lower "
                f"swap_space_gib, n_ctx, max_model_len or max_num_seqs, or choose a smaller weight_dtype")
