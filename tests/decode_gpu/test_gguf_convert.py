"""The streamed GGUF -> safetensors conversion: same weights as transformers' loader, bounded memory."""

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from contracts.identity import read_gguf_identity
from decode_gpu.model.gguf_convert import INDEX_NAME, convert_gguf
from decode_gpu.model.loader import converted_dir, converted_weights_dir, load_decode_model

REPO = Path(__file__).resolve().parents[2]


def transformers_state_dict(gguf_path: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.state_dict()


def assert_same_weights(folder: Path, expected: dict[str, torch.Tensor]) -> None:
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("arch, weight_dtype", [("llama", "f32"), ("llama", "f16"), ("qwen2", "f32"), ("qwen2", "f16")])
def test_streamed_equals_transformers_loader_on_tiny_models(tiny_gguf, tmp_path, arch, weight_dtype):
    path = tiny_gguf(arch, weight_dtype)
    convert_gguf(path, tmp_path / "w", torch.float32, shard_bytes=2**20)  # ~6 shards for the ~5 MB model
    assert len(list((tmp_path / "w").glob("model-*-of-*.safetensors"))) > 1
    assert_same_weights(tmp_path / "w", transformers_state_dict(path))


@pytest.mark.slow
def test_streamed_equals_transformers_loader_on_embedded_q4_1_model(embedded_model_path, tmp_path):
    """Q4_1 blocks are dequantized, and lm_head is tied to the embeddings (the GGUF has no output.weight)."""
    path = Path(embedded_model_path)
    assert "output.weight" not in {tensor.name for tensor in gguf.GGUFReader(path).tensors}
    convert_gguf(path, tmp_path / "w", torch.float32)
    weight_map = json.loads((tmp_path / "w" / INDEX_NAME).read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map and "model.embed_tokens.weight" in weight_map
    assert_same_weights(tmp_path / "w", transformers_state_dict(path))


def test_each_dtype_has_its_own_cache_folder(tiny_gguf, tmp_path):
    identity = read_gguf_identity(str(tiny_gguf("qwen2", "f32")))
    old_layout = converted_dir(identity, tmp_path)  # weights stored there before the per-dtype folders
    old_layout.mkdir(parents=True)
    (old_layout / "model.safetensors").write_bytes(b"old weights")
    (old_layout / "config.json").write_text("{}")
    full = load_decode_model(identity, torch.device("cpu"), torch.float32, tmp_path)
    assert not (old_layout / "model.safetensors").exists() and not (old_layout / "config.json").exists()
    half = load_decode_model(identity, torch.device("cpu"), torch.bfloat16, tmp_path)
    folders = {converted_weights_dir(identity, dtype, tmp_path) for dtype in (torch.float32, torch.bfloat16)}
    assert {folder.name for folder in folders} == {"float32", "bfloat16"}
    assert {folder.parent for folder in folders} == {converted_dir(identity, tmp_path)}
    shard = next(converted_weights_dir(identity, torch.bfloat16, tmp_path).glob("model-*.safetensors"))
    with safe_open(shard, "pt") as stored:
        assert {stored.get_tensor(name).dtype for name in stored.keys()} == {torch.bfloat16}
    half_weights = half.state_dict()
    for name, tensor in full.state_dict().items():  # the bfloat16 cache is the float32 one, rounded
        assert torch.equal(half_weights[name], tensor.to(torch.bfloat16)), name


# Runs in a fresh interpreter so that the peak RSS is the conversion's alone: VmHWM, not ru_maxrss, which
# an exec'd child inherits from the (large) pytest process it was forked from. The warm-up conversion
# imports everything the conversion uses, so the growth measured after it is tensors and shards.
MEASURE = """
import sys
from pathlib import Path
import psutil, torch
from decode_gpu.model.gguf_convert import convert_gguf
warmup, big, out = map(Path, sys.argv[1:])
convert_gguf(warmup, out / "warmup", torch.float32)
before = psutil.Process().memory_info().rss
convert_gguf(big, out / "big", torch.float32, shard_bytes=16 * 2**20)
peak_kb = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1]
print(int(peak_kb) * 1024 - before)
"""

N_EMBD, N_FF, N_LAYER, N_VOCAB = 1024, 4096, 8, 512


def write_q4_0_llama(path: Path) -> int:
    """An 8-layer llama of Q4_0 matrices, 16 MB per FFN matrix in float32; returns its float32 byte count.

    Q4_0 because the GGUF's mapped pages stay resident once read: at 4.5 bits a weight they are 14% of that count."""
    rng = np.random.default_rng(0)
    ffn = gguf.quants.quantize(rng.standard_normal((N_FF, N_EMBD), dtype=np.float32), gguf.GGMLQuantizationType.Q4_0)
    attn = gguf.quants.quantize(rng.standard_normal((N_EMBD, N_EMBD), dtype=np.float32), gguf.GGMLQuantizationType.Q4_0)
    tensors = {"token_embd.weight": rng.standard_normal((N_VOCAB, N_EMBD), dtype=np.float32),
               "output_norm.weight": np.ones(N_EMBD, np.float32)}
    for il in range(N_LAYER):  # the same blocks in every layer: the memory is what is measured, not the values
        tensors |= {f"blk.{il}.attn_{name}.weight": attn for name in ("q", "k", "v", "output")}
        tensors |= {f"blk.{il}.ffn_{name}.weight": ffn for name in ("gate", "up")}
        tensors[f"blk.{il}.ffn_down.weight"] = ffn.reshape(N_EMBD, -1)  # [n_embd, n_ff] in blocks
        tensors |= {f"blk.{il}.{name}_norm.weight": np.ones(N_EMBD, np.float32) for name in ("attn", "ffn")}
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_llama_hparams(writer)
    for name, array in tensors.items():
        quantized = array.dtype == np.uint8
        writer.add_tensor(name, array, raw_dtype=gguf.GGMLQuantizationType.Q4_0 if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return 4 * (N_VOCAB * N_EMBD + N_LAYER * (4 * N_EMBD * N_EMBD + 3 * N_FF * N_EMBD))


def _write_llama_hparams(writer: gguf.GGUFWriter) -> None:
    writer.add_context_length(2048)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(8)
    writer.add_head_count_kv(8)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(N_VOCAB)


@pytest.mark.slow
def test_peak_memory_is_a_few_tensors_not_the_model(tiny_gguf, tmp_path):
    """transformers' own loader grows by 1.2x the float32 size here; the streamed conversion by about 0.25x."""
    model_bytes = write_q4_0_llama(tmp_path / "big.gguf")
    assert model_bytes > 150 * 2**20
    done = subprocess.run([sys.executable, "-c", MEASURE, str(tiny_gguf("llama", "f32")), str(tmp_path / "big.gguf"),
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    growth = int(done.stdout.split()[-1])
    assert len(list((tmp_path / "big").glob("model-*.safetensors"))) > 8  # it did flush as it went
    assert growth < 0.4 * model_bytes, f"peak RSS grew {growth / 2**20:.0f} MB for a {model_bytes / 2**20:.0f} MB model"
