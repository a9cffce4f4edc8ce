"""GGUF files: config, tokenizer, chat template and weights from one file.

The oracle is transformers' own GGUF loading of the same file (`gguf_file=`), which
dequantizes with the same `gguf` package, so greedy tokens must match exactly. One gap in
it: transformers reads no head_dim from a Qwen3 file and takes Qwen3Config's default, 128.
The wide fixtures have that head_dim; files of other head sizes are checked against the
checkpoint they were written from instead.
"""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from oracle import greedy, hf_greedy, random_prompts
from quantized_helpers import build_wide, largest_greedy_gap, quantized_llm
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanoqwen import LLM
from nanoqwen.cli import weights_kept_as
from nanoqwen.text.tokenizer import Tokenizer
from nanoqwen.weights.checkpoint import read_checkpoint
from nanoqwen.weights.formats import GGUF_GROUP_SIZE, WeightQuantization
from nanoqwen.weights.gguf import (
    FOUR_BIT_TYPES,
    PlainArrayReader,
    four_bit_codes,
    open_gguf,
)
from nanoqwen.weights.loader import load_model
from nanoqwen.weights.quantization import Int4Linear, Int8Embedding, Int8Linear
from tools.checkpoints import IM_END, build_qwen3, generate_corpus
from tools.gguf_files import F, all_of, k_quant_mix, write_gguf

FILE_TYPES = {"F16": all_of(F.F16), "BF16": all_of(F.BF16), "Q8_0": all_of(F.Q8_0), "Q4_K_M": k_quant_mix}
# What the run-time quantization follows by default: the bits most of the matrices have.
DEFAULT_QUANTIZATION = {
    "F16": None,
    "BF16": None,
    "Q8_0": WeightQuantization("int8"),
    "Q4_K_M": WeightQuantization("int4", 32),
}


@pytest.fixture(scope="module")
def wide_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {arch: build_wide(arch, tmp_path_factory.mktemp(arch)) for arch in ("qwen2", "qwen3")}


@pytest.mark.parametrize(
    "architecture, file_type",
    [("qwen2", "F16"), ("qwen2", "Q8_0"), ("qwen2", "Q4_K_M"), ("qwen3", "BF16"), ("qwen3", "Q8_0"), ("qwen3", "Q4_K_M")],
)
def test_greedy_matches_transformers_gguf_loading(
    wide_dirs: dict[str, str], tmp_path: Path, architecture: str, file_type: str
) -> None:
    path = write_gguf(wide_dirs[architecture], tmp_path / "model.gguf", FILE_TYPES[file_type])
    assert read_checkpoint(path).quantization == DEFAULT_QUANTIZATION[file_type]
    llm = quantized_llm(path, "none")
    prompts = random_prompts(800, [5, 40], seed=21)
    for prompt, output in zip(prompts, llm.generate(prompts, greedy(8))):
        assert output.token_ids == hf_greedy(path, prompt, 8)


def test_float32_file_runs_like_the_checkpoint_it_was_written_from(model_dir: str, tmp_path: Path) -> None:
    path = write_gguf(model_dir, tmp_path / "model.gguf", all_of(F.F32))
    ours, source = read_checkpoint(path).model_config, read_checkpoint(model_dir).model_config
    shape = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
             "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "qk_norm")
    assert {k: getattr(ours, k) for k in shape} == {k: getattr(source, k) for k in shape}
    prompt = random_prompts(800, [30], seed=22)[0]
    assert LLM(path, device="cpu", num_pages=64).generate([prompt], greedy(12))[0].token_ids == hf_greedy(model_dir, prompt, 12)


def test_rope_scaling_comes_from_the_file(tmp_path: Path) -> None:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    model_dir = build_qwen3(tmp_path / "yarn", rope_parameters=rope, max_position_embeddings=64)
    path = write_gguf(model_dir, tmp_path / "yarn.gguf", all_of(F.F32))
    prompt = random_prompts(800, [90], seed=23)[0]
    output = LLM(path, device="cpu", max_model_len=200, num_pages=64).generate([prompt], greedy(8))[0]
    assert output.token_ids == hf_greedy(model_dir, prompt, 8)


def test_tokenizer_and_chat_template_come_from_the_file(qwen3_dir: str, tmp_path: Path) -> None:
    path = write_gguf(qwen3_dir, tmp_path / "model.gguf", all_of(F.F16))
    ours, source = Tokenizer(path), Tokenizer(qwen3_dir)
    text = "\n".join(generate_corpus(num_lines=20, seed=5))
    assert ours.encode(text) == source.encode(text)
    ids = source.encode(text)
    assert ours.decode(ids) == source.decode(ids) == text
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "café 你好 😀"}]
    for thinking in (None, False):
        assert ours.apply_chat_template(conversation, thinking) == source.apply_chat_template(conversation, thinking)
    assert source.encode(IM_END)[0] in ours.eos_token_ids


def test_unsupported_architecture_names_the_file(qwen2_dir: str, tmp_path: Path) -> None:
    path = write_gguf(qwen2_dir, tmp_path / "llama.gguf", all_of(F.F16), architecture="llama")
    with pytest.raises(ValueError, match=r"llama\.gguf: GGUF architecture 'llama' is not supported; nanoqwen runs qwen2, qwen3"):
        LLM(path, device="cpu")


@pytest.mark.parametrize(
    "damage",
    [lambda data: data[: len(data) // 2], lambda data: b"GGML" + data[4:], lambda data: b""],
    ids=["truncated", "bad-magic", "empty"],
)
def test_damaged_file_is_a_clear_error(qwen2_dir: str, tmp_path: Path, damage) -> None:
    path = Path(write_gguf(qwen2_dir, tmp_path / "model.gguf", all_of(F.Q8_0)))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=r"model\.gguf is not a readable GGUF file"):
        LLM(str(path), device="cpu")


def test_tensor_of_a_type_that_cannot_be_dequantized(wide_dirs: dict[str, str], tmp_path: Path) -> None:
    def q8_k_up_projection(name: str, shape: tuple[int, ...]) -> gguf.GGMLQuantizationType:
        return F.Q8_K if name == "blk.1.ffn_up.weight" else all_of(F.F16)(name, shape)

    path = write_gguf(wide_dirs["qwen2"], tmp_path / "model.gguf", q8_k_up_projection)
    with pytest.raises(ValueError, match=r"model\.gguf: tensor 'blk\.1\.ffn_up\.weight' has type Q8_K"):
        LLM(path, device="cpu")


def test_missing_tensor_is_named_as_transformers_names_it(qwen2_dir: str, tmp_path: Path) -> None:
    path = write_gguf(qwen2_dir, tmp_path / "model.gguf", all_of(F.F16), drop=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match=r"missing weight 'model\.layers\.1\.mlp\.down_proj\.weight'"):
        LLM(path, device="cpu")


def test_path_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model path not found: models/missing\.gguf"):
        LLM("models/missing.gguf", device="cpu")  # not a hub id, though it has one slash
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"weights\.bin is a file: pass a checkpoint directory or a \.gguf file"):
        LLM(str(tmp_path / "weights.bin"), device="cpu")


# How far below the best logit of the file's float32 model a greedy token of its int4 run may fall.
LARGEST_GAP = {"qwen2": 0.4, "qwen3": 0.1}
FOUR_BIT_FILES = {"Q4_0": all_of(F.Q4_0), "Q4_1": all_of(F.Q4_1), "Q4_K_M": k_quant_mix}


@pytest.fixture(scope="module")
def four_bit_tensors(
    wide_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> list[gguf.ReaderTensor]:
    """Every tensor of a 4-bit type in a Q4_0, a Q4_1 and a Q4_K_M file of the wide model."""
    directory = tmp_path_factory.mktemp("four-bit")
    tensors = []
    for name, choose in FOUR_BIT_FILES.items():
        path = write_gguf(wide_dirs["qwen2"], directory / f"{name}.gguf", choose)
        tensors += [t for t in gguf.GGUFReader(path).tensors if t.tensor_type in FOUR_BIT_TYPES]
    assert {t.tensor_type for t in tensors} == set(FOUR_BIT_TYPES)
    return tensors


def per_weight(groups: torch.Tensor) -> torch.Tensor:
    return groups.repeat_interleave(GGUF_GROUP_SIZE, dim=1)


def test_four_bit_codes_are_the_files_own(four_bit_tensors: list[gguf.ReaderTensor]) -> None:
    """Codes, scales and offsets give back exactly what the `gguf` package dequantizes."""
    for tensor in four_bit_tensors:
        codes = four_bit_codes(tensor)
        assert codes.codes.dtype == torch.int32 and int(codes.codes.max()) <= 15
        expected = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type))
        assert torch.equal(codes.weight(), expected)  # the weight the loader reads


def test_the_reader_reads_what_ggufs_own_reads(qwen3_dir: str, tmp_path: Path) -> None:
    """The plain view of the mapping (what transformers reads through) gives the same
    metadata and tensors; `open_gguf`'s reader the same but for arrays, left unread."""
    path = write_gguf(qwen3_dir, tmp_path / "model.gguf", k_quant_mix)
    plain, tensors, theirs = PlainArrayReader(path), open_gguf(path), gguf.GGUFReader(path)
    arrays = [key for key, field in theirs.fields.items() if field.types[0] == gguf.GGUFValueType.ARRAY]
    assert "tokenizer.ggml.merges" in arrays and "tokenizer.ggml.token_type" in arrays
    for ours in plain, tensors:
        assert ours.fields.keys() == theirs.fields.keys()
        for key, field in theirs.fields.items():
            expected = [] if ours is tensors and key in arrays else field.contents()
            assert ours.fields[key].contents() == expected, key
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


def test_int4_linear_multiplies_by_the_files_weights(four_bit_tensors: list[gguf.ReaderTensor]) -> None:
    """An `Int4Linear` keeps the file's codes: its weights differ from the file's only by
    the bfloat16 rounding of each group's scale and zero, and its products are the float
    products of the file's weights, within bfloat16's precision."""
    generator = torch.Generator().manual_seed(3)
    for tensor in four_bit_tensors:
        codes = four_bit_codes(tensor)
        out_features, in_features = codes.codes.shape
        linear = Int4Linear(torch.nn.Linear(in_features, out_features, bias=False), codes)
        scales, zeros = linear.scales_and_zeros.float().transpose(0, 1).unbind(-1)
        kept = (codes.codes.float() - 8) * per_weight(scales) + per_weight(zeros)
        exact = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type))
        # bfloat16 rounds to 8 significant bits: the scale times |code - 8| <= 8, and the zero.
        bound = 2**-8 * (8 * per_weight(scales.abs()) + per_weight(zeros.abs()))
        assert ((kept - exact).abs() <= bound).all(), tensor.name
        # Rows as a view of another layout, as attention hands them on.
        rows = torch.randn(in_features, 3, generator=generator).to(torch.bfloat16).T
        expected = rows.float() @ exact.T
        torch.testing.assert_close(
            linear(rows).float(), expected, rtol=2**-7, atol=2**-7 * float(expected.abs().max())
        )


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_a_4_bit_file_keeps_its_own_codes_on_a_cpu(
    wide_dirs: dict[str, str], tmp_path: Path, architecture: str
) -> None:
    """Following a Q4_K_M file on a CPU keeps the Q4_K tensors' own codes (`Int4Linear`)
    and makes int8 rows of the rest (Q6_K, Q5_K; a fused layer with a part in one of those,
    here qkv, whose v is Q6_K): greedy tokens part from the file's own (dequantized) model,
    as transformers reads it, only at near-ties. Both kernels take bfloat16 activations,
    whose rounding is most of the difference: on qwen2's first prompt int8 rows also pick a
    token 0.34 below the best."""
    path = write_gguf(wide_dirs[architecture], tmp_path / "model.gguf", k_quant_mix)
    llm = LLM(path, device="cpu", num_pages=64)
    assert weights_kept_as(llm.engine) == "the file's 4-bit codes, int8 for its other types and the embedding"
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, Int4Linear) and isinstance(layer.self_attn.o_proj, Int4Linear)
    assert isinstance(layer.mlp.down_proj, Int8Linear) and isinstance(layer.self_attn.qkv_proj, Int8Linear)
    # qwen2's fixture has an lm_head of its own, in Q4_K; qwen3's is its Q5_K embedding.
    assert isinstance(model.lm_head, Int4Linear if architecture == "qwen2" else Int8Linear)
    prompts = random_prompts(800, [6, 45, 20, 30], seed=33)
    for prompt, output in zip(prompts, llm.generate(prompts, greedy(12))):
        assert largest_greedy_gap(path, prompt, output.token_ids) <= LARGEST_GAP[architecture]


class FloatTensorsMade(TorchDispatchMode):
    """The shapes of the float tensors every torch operation makes on a real device."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.shapes |= {tuple(t.shape) for t in made if t.is_floating_point() and not t.is_meta}
        return out


def test_a_4_bit_layer_is_never_held_in_full_precision(wide_dirs: dict[str, str], tmp_path: Path) -> None:
    """Loading a Q4_K_M file on a CPU makes its 4-bit layers' `Int4Linear`s straight from
    the file's codes: no float tensor of their weight's shape, or of one of its parts', is
    ever made (a whole float model allocated first would make them all)."""
    path = write_gguf(wide_dirs["qwen3"], tmp_path / "model.gguf", k_quant_mix)
    with FloatTensorsMade() as made:
        model = load_model(read_checkpoint(path), torch.float32, torch.device("cpu"))
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, Int4Linear)
    rows, columns = gate_up.out_features, gate_up.in_features
    assert made.shapes and not made.shapes & {(rows, columns), (rows // 2, columns)}
    assert not any(isinstance(module, torch.nn.Linear) for module in model.modules())


def test_a_4_bit_files_embedding_is_int8_rows_of_its_weights(
    wide_dirs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedding is kept as int8 rows, read a few rows at a time, which the tied lm_head
    shares: each weight within half a code step of the file's, plus the bfloat16 rounding
    of its row's scale (at most 127 steps times 2^-8)."""
    monkeypatch.setattr("nanoqwen.weights.gguf_codes.ROWS_PER_READ", 7)  # rows not a multiple
    path = write_gguf(wide_dirs["qwen3"], tmp_path / "model.gguf", k_quant_mix)
    model = load_model(read_checkpoint(path), torch.float32, torch.device("cpu"))
    embedding = model.model.embed_tokens
    assert isinstance(embedding, Int8Embedding) and model.lm_head.codes is embedding.codes
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}["token_embd.weight"]
    exact = torch.from_numpy(gguf.dequantize(stored.data, stored.tensor_type))
    step = exact.abs().amax(dim=1, keepdim=True) / 127
    kept = embedding(torch.arange(len(exact)))
    assert kept.dtype == torch.float32
    assert ((kept - exact).abs() <= step * (0.5 + 127 * 2**-8)).all()


def test_int8_asked_for_makes_every_linear_of_a_4_bit_file_int8(wide_dirs: dict[str, str], tmp_path: Path) -> None:
    path = write_gguf(wide_dirs["qwen2"], tmp_path / "model.gguf", k_quant_mix)
    engine = quantized_llm(path, "int8", device="cpu").engine
    assert weights_kept_as(engine) == "int8 codes from GGUF"  # as chat's banner and serve's log say
    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Int4Linear, Int8Linear))]
    assert linears and all(isinstance(linear, Int8Linear) for linear in linears)
