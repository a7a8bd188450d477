"""One memory budget per box, planned before anything loads (DESIGN.md, "Memory is the budget").

From a model's sizes (contracts/model_sizes.py, read from its GGUF header), the machine's memory and the serve
config, the plan decides what each process may hold, and refuses a model that cannot fit (MemoryRefused, each
part's bytes and the budget named). Pure Python: `edge serve` plans before it starts a process, `edge check-model
--memory` prints the same plan.

Required, in this order: the decode weights (one set), each process's runtime, the swap space, the prefill workers
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

from contracts.model_sizes import FLOAT_BYTES, GGUF_EXACT_INT4, ModelSizes

MIB, GIB = 2**20, 2**30
CPU_SHARE, CUDA_SHARE = 0.85, 0.90  # the default budget: this share of the RAM (CPU) or of the device's memory (CUDA)
# idle RSS beyond weights, KV and buffers, embedded model, 2-core box (docs/sizes.md): a worker 118 MiB (Python,
# llama-cpp-python, the tokenizer); the CPU engine 611 MiB (Python, torch, transformers' tokenizer, grammar tables,
# the allocator's slack); the gateway 166 MiB. Rounded up: a larger vocabulary adds to each
WORKER_RUNTIME = 150 * MIB
ENGINE_RUNTIME = 700 * MIB
GATEWAY_RUNTIME = 200 * MIB
CUDA_CONTEXT = 600 * MIB  # on the device: the CUDA context, cuBLAS workspaces (not measured here: no GPU)
KV_FLOOR_TOKENS = 8192  # the pool's floor: this, or 4 x max_model_len if more (never above every sequence's longest)
GGUF_INT8 = {"Q8_0", "Q8_1", "Q8_K"}  # weight_dtype auto on CUDA follows the GGUF (decode_gpu/model/weight_plan.py)
GGUF_INT4 = {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
COPIES = ("f16", "q8_0")  # prefill_weights auto's copies, best first


class MemoryRefused(ValueError):
    """The model cannot be served within the budget, even with one weight set, one worker and the KV floor."""


@dataclass(frozen=True)
class Machine:
    device: str  # where the decode engine runs: "cpu" or "cuda"
    host_bytes: int  # the RAM
    device_bytes: int = 0  # the GPU's memory (cuda)


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
    prefix_cache_tokens: int = 2048
    max_num_seqs: int = 32
    max_model_len: int = 4096
    swap_space_gib: float = 4.0


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

    def used(self, where: str) -> int:
        return sum(p.bytes for p in self.parts if p.where == where)

    def part_bytes(self) -> dict[str, int]:
        return {p.name: p.bytes for p in self.parts}

    def describe(self) -> str:
        """The table `edge check-model --memory` prints: each part, the totals against the budgets, the decisions."""
        lines = [f"{'part':34} {'where':6} {'MiB':>10}  note"]
        lines += [f"{p.name:34} {p.where:6} {p.bytes / MIB:10.1f}  {p.note}" for p in self.parts]
        for where, budget in self.budgets.items():
            used = self.used(where)
            share = used / budget
            lines.append(f"{'total':34} {where:6} {used / MIB:10.1f}  of the {budget / MIB:.1f} MiB budget "
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
        self.reasons: dict[str, str] = {}

    def plan(self) -> MemoryPlan:
        quantized, floating = self._weight_sets()
        one_set = quantized or floating
        workers = self._workers(one_set)
        copy = self._prefill_copy(one_set, workers)
        second, float_alone = self._second_set(quantized, floating, workers, copy)
        held = floating if float_alone and not second else one_set  # auto may keep float alone: room for it
        parts = self._required(held, workers, copy)
        if second:
            parts.insert(1, Part(f"decode weights, {floating[0]} set too", floating[1], self.engine_at,
                                 "for batches the quantized kernels lose at"))
        tokens = min(self.kv_cap, self.kv_floor + self._left(parts) // self.per_token)
        parts[-1] = self._kv_part(tokens)
        self.reasons.setdefault("kv_cache_tokens", f"{tokens}: what is left"
                                + (", up to every sequence at its longest (max_num_seqs x max_model_len)"
                                   if tokens == self.kv_cap and not self.config.kv_cache_tokens else ""))
        return MemoryPlan(self.budgets, tuple(parts), self._told(quantized, floating, second, float_alone), second,
                          float_alone, copy, workers, tokens, self.swap_bytes, dict(self.reasons))

    # the weight sets: (weight_dtype, bytes) each, None where the config rules it out
    def _weight_sets(self) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
        config, sizes = self.config, self.sizes
        wanted = config.weight_dtype
        if wanted in FLOAT_BYTES:
            return None, (wanted, sizes.decode_weight_bytes(wanted, config.dtype))
        if wanted != "auto":
            return (wanted, sizes.decode_weight_bytes(wanted, config.dtype)), None
        if self.machine.device == "cuda":  # the GGUF's own quantization, one set
            kind = "int4" if sizes.layer_types & GGUF_INT4 else "int8" if sizes.layer_types & GGUF_INT8 else None
            if kind is None:
                return None, (config.dtype, sizes.decode_weight_bytes(config.dtype, config.dtype))
            return (kind, sizes.decode_weight_bytes(kind, config.dtype)), None
        # a CPU: auto measures int4 (every layer affine 4-bit) or int8, and ggml's q8_0: room for the larger
        kind = "int4" if sizes.layer_types and sizes.layer_types <= GGUF_EXACT_INT4 else "int8"
        quantized = max(sizes.decode_weight_bytes(k, config.dtype) for k in (kind, "q8_0"))
        return (kind, quantized), (config.dtype, sizes.decode_weight_bytes(config.dtype, config.dtype))

    def _required(self, weights: tuple[str, int], workers: int, copy: str | None) -> list[Part]:
        config, sizes = self.config, self.sizes
        rows = config.max_num_seqs  # a step's logits, probabilities and sampling scratch, and its activations
        activations = rows * 4 * (4 * sizes.n_vocab + 4 * sizes.n_ff + 8 * sizes.n_embd)
        kv_cells = config.n_ctx + config.prefix_cache_tokens
        worker_each = (WORKER_RUNTIME + kv_cells * sizes.handoff_kv_bytes(config.kv_type) + self._compute_buffer())
        given = copy is None
        parts = [Part(f"decode weights, {weights[0]}", weights[1], self.engine_at),
                 Part("engine runtime", ENGINE_RUNTIME + (0 if self.engine_at == "device" else activations), "host",
                      "Python, torch, tokenizer" + ("" if self.engine_at == "device" else ", a step's activations")),
                 Part("swap space (at most)", self.swap_bytes, "host",
                      "preempted sequences' KV: swap_space_gib or the pool's floor, the lesser"),
                 Part("gateway runtime", GATEWAY_RUNTIME, "host"),
                 Part(f"prefill weights, {'the given GGUF' if given else copy + ' copy'}",
                      sizes.file_bytes if given else sizes.copy_bytes(copy), "host", "mmap'd: shared by the workers"),
                 Part(f"prefill workers x{workers}", workers * worker_each, "host",
                      f"each: runtime, llama.cpp KV of {kv_cells} tokens ({config.kv_type}), compute buffer")]
        if self.engine_at == "device":
            parts.insert(2, Part("CUDA context, activations", CUDA_CONTEXT + activations, "device"))
        return [*parts, self._kv_part(self.kv_floor)]

    def _kv_part(self, tokens: int) -> Part:
        return Part(f"decode KV pool, {tokens} tokens", tokens * self.per_token, self.engine_at,
                    f"{self.pool_storage}, {self.per_token / 1024:.1f} KiB a token")

    def _compute_buffer(self) -> int:
        """llama.cpp's compute buffer at n_batch: the output logits and the widest activations (f32)."""
        sizes = self.sizes
        return self.config.n_batch * 4 * (sizes.n_vocab + 3 * sizes.n_ff + 6 * sizes.n_embd)

    def _left(self, parts: list[Part]) -> int:
        """What the pool's budget has left after `parts`."""
        return self.budgets[self.engine_at] - self._used(parts, self.engine_at)

    @staticmethod
    def _used(parts: list[Part], where: str) -> int:
        return sum(p.bytes for p in parts if p.where == where)

    def _fits(self, parts: list[Part]) -> bool:
        return all(self._used(parts, where) <= budget for where, budget in self.budgets.items())

    def _workers(self, weights: tuple[str, int]) -> int:
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

    def _prefill_copy(self, weights: tuple[str, int], workers: int) -> str | None:
        wanted, sizes = self.config.prefill_weights, self.sizes
        if wanted != "auto":
            self.reasons["prefill_copy"] = f"prefill_weights = {wanted!r}"
            return self._named_copy()
        if sizes.unconverted:
            self.reasons["prefill_copy"] = "none: the GGUF has 16 or 32 bits a weight already"
            return None
        for kind in COPIES:
            if self._fits(self._required(weights, workers, kind)):
                self.reasons["prefill_copy"] = (f"{kind} allowed ({sizes.copy_bytes(kind) / GIB:.2f} GiB, mmap'd by "
                                                f"every worker); auto keeps it if it prefills faster")
                return kind
        self.reasons["prefill_copy"] = (f"none: an f16 copy ({sizes.copy_bytes('f16') / GIB:.2f} GiB) or q8_0 would "
                                        f"not fit beside the required parts")
        return None

    def _second_set(self, quantized, floating, workers: int, copy: str | None) -> tuple[bool, bool]:
        """(both sets held, the float set alone allowed) for auto on a CPU; the one configured set otherwise."""
        if quantized is None or floating is None:
            self.reasons["weights"] = f"{(quantized or floating)[0]}: one set ({self._why_one_set()})"
            return False, floating is not None
        both = self._required(quantized, workers, copy)
        both.append(Part("float set", floating[1], self.engine_at))
        if self._fits(both):
            self.reasons["weights"] = (f"auto: {quantized[0]} and {floating[0]} sets both fit "
                                       f"({(quantized[1] + floating[1]) / GIB:.2f} GiB)")
            return True, True
        float_alone = self._fits(self._required(floating, workers, copy))
        self.reasons["weights"] = (
            f"one set: {quantized[0]} ({quantized[1] / GIB:.2f} GiB) and {floating[0]} ({floating[1] / GIB:.2f} GiB) "
            f"do not both fit; " + ("auto keeps the one faster at one row" if float_alone else
                                    f"{floating[0]} alone does not fit either: {quantized[0]}"))
        return False, float_alone

    def _why_one_set(self) -> str:
        if self.config.weight_dtype != "auto":
            return f"weight_dtype = {self.config.weight_dtype!r}"
        return "auto on CUDA: the GGUF's own quantization"

    def _told(self, quantized, floating, second: bool, float_alone: bool) -> str:
        """The weight_dtype the engine is told: auto where it may still measure, else the one set the budget holds."""
        if self.config.weight_dtype != "auto" or quantized is None or floating is None:
            return self.config.weight_dtype
        return "auto" if second or float_alone else quantized[0]

    def _refusal(self, parts: list[Part]) -> str:
        listed = "; ".join(f"{p.name} {p.bytes / MIB:.0f} MiB ({p.where})" for p in parts)
        budgets = ", ".join(f"{where} {budget / MIB:.0f} MiB, {self._used(parts, where) / MIB:.0f} MiB asked"
                            for where, budget in self.budgets.items())
        return (f"{self.sizes.name} does not fit the memory budget even with one weight set, one prefill worker "
                f"and a KV pool of {self.kv_floor} tokens: {listed}; budget {budgets}. Raise memory_budget, or lower "
                f"swap_space_gib, n_ctx, max_model_len or max_num_seqs, or choose a smaller weight_dtype")
