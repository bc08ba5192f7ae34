"""Real tokenizers generated in-process: CLIP's byte-level BPE, T5's Unigram, Qwen's byte-level BPE.

Nothing can be downloaded where the tiny models are built, yet every pipeline must tokenize
through the real `transformers` tokenizer classes (`CLIPTokenizer`, `T5TokenizerFast`,
`Qwen2TokenizerFast`), with the special tokens, padding and templates the pipelines rely on.
So each vocabulary is learnt here from a few fixed sentences of the prompts the tests and the
demo use; the algorithms are the real ones (BPE merges, a `tokenizers` Unigram model), only the
corpora are tiny. Everything is deterministic: the same code writes the same files.
"""

from __future__ import annotations

import json
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

# Words the CLIP BPE merges are learnt from: prompts the tests and demo use.
_CORPUS = (
    "a photo of sks dog cat person man woman in the style on beach park forest city street "
    "portrait picture painting drawing sketch red blue green yellow small large cute happy "
    "sitting standing running wearing hat with and at by near under over night day sunny "
    "snow water mountain house car toy bear robot flower tree sky light dark close up"
)
_NUM_MERGES = 200
_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"

# Sentences the T5 Unigram and Qwen BPE models are trained on (the word list, plus prompts).
SENTENCES = (
    _CORPUS,
    "a photo of sks dog",
    "a photo of sks dog in the snow",
    "a painting of sks cat in the style of a sketch",
    "a close up portrait of a happy person wearing a red hat",
    "a small robot toy standing near a tree at night",
    "a large house by the water under a sunny sky",
    "system user assistant",  # the roles of Qwen's chat template
)
# Every printable ASCII character is a piece of its own, so no prompt falls back to `<unk>` on
# a letter the sentences happen not to contain (the real T5 vocabulary has them all too).
_ALPHABET = [chr(c) for c in range(ord("!"), ord("~") + 1)]

T5_PAD, T5_EOS, T5_UNK = "<pad>", "</s>", "<unk>"
T5_EXTRA_IDS = 100  # T5's sentinel tokens <extra_id_0..99>, at the end of its vocabulary.
T5_MAX_TOKENS = 512  # FluxPipeline's max_sequence_length for FLUX.1-dev.
_T5_PIECES = 300
_SCORE_DECIMALS = 6

QWEN_PAD = "<|endoftext|>"
QWEN_IM_START = "<|im_start|>"
QWEN_IM_END = "<|im_end|>"
QWEN_THINK = ("<think>", "</think>")
_QWEN_VOCAB = 600
# Qwen3's tokenizer_config.json: `model_max_length` 131072.
_QWEN_MAX_TOKENS = 131072

# The chat template of Qwen3 for what text-to-image pipelines send it (system and user turns of
# plain text): it renders exactly what Qwen3's own template renders for them, including the
# empty thinking block that `enable_thinking=False` adds after the generation prompt, which
# Flux2KleinPipeline asks for. Assistant turns (Qwen3 rewrites their thinking blocks), tool
# calls and multi-part contents, which no pipeline sends, are refused rather than rendered
# differently.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.content is not string %}"
    "{{- raise_exception('only plain-text message contents are supported') }}"
    "{%- endif %}"
    "{%- if message.role in ['system', 'user'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- raise_exception('unsupported role: ' + message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2/CLIP byte-level alphabet: every byte mapped to a printable character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars: list[int] = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small CLIP-style vocabulary: byte alphabet, end-of-word forms, learnt merges, specials.

    The merges are learnt with plain BPE over `_CORPUS` so common prompt words become single
    tokens, as they are in the real CLIP vocabulary. Deterministic: ties break alphabetically.
    """
    alphabet = _byte_alphabet()
    tokens: list[str] = [*alphabet, *(c + "</w>" for c in alphabet)]
    words: Counter[tuple[str, ...]] = Counter()
    for word in _CORPUS.split():
        words[(*word[:-1], word[-1] + "</w>")] += 1
    merges: list[tuple[str, str]] = []
    while len(merges) < _NUM_MERGES:
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, count in words.items():
            for pair in pairwise(symbols):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        tokens.append(best[0] + best[1])
        merged: Counter[tuple[str, ...]] = Counter()
        for symbols, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    # As in CLIP, the special tokens take the last ids.
    tokens += [_BOS, _EOS]
    return {token: index for index, token in enumerate(tokens)}, merges


def write_clip_tokenizer(directory: Path, max_tokens: int) -> None:
    """`vocab.json`, `merges.txt` and a config that `CLIPTokenizer.from_pretrained` reads."""
    vocab, merges = bpe_vocab_and_merges()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2", *(f"{a} {b}" for a, b in merges)]
    (directory / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"model_max_length": max_tokens, "tokenizer_class": "CLIPTokenizer"}),
        encoding="utf-8",
    )


def t5_unigram_pieces() -> list[tuple[str, float]]:
    """T5's vocabulary layout with pieces learnt by a `tokenizers` Unigram trainer.

    As in T5: `<pad>` 0, `</s>` 1, `<unk>` 2, the learnt pieces (SentencePiece's `▁` marks a word
    start), then the sentinels `<extra_id_99>` … `<extra_id_0>`. The pre-tokenizer is the one
    `T5TokenizerFast` uses, so the pieces are the ones it will look up.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    trainer = trainers.UnigramTrainer(
        vocab_size=_T5_PIECES,
        special_tokens=[T5_PAD, T5_EOS, T5_UNK],
        unk_token=T5_UNK,
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(SENTENCES), trainer)
    learnt: list[list[Any]] = json.loads(tokenizer.to_str())["model"]["vocab"]
    specials = [str(piece) for piece, _ in learnt[:3]]
    if specials != [T5_PAD, T5_EOS, T5_UNK]:
        raise AssertionError(f"Unigram trainer reordered the special tokens: {specials}")
    # The trainer is not reproducible bit for bit: pieces of equal score come out in hash-map
    # order, and its parallel sums differ in the last bits with the thread count. Rounded scores
    # and a total order make the same vocabulary the same file every time.
    scored = sorted(
        ((str(piece), round(float(score), _SCORE_DECIMALS)) for piece, score in learnt[3:]),
        key=lambda item: (-item[1], item[0]),
    )
    # Characters the sentences lack become pieces of their own, least likely of all (the
    # trainer's `initial_alphabet` would add them too, but scored in hash-set order).
    known = {piece for piece, _ in scored}
    rarest = scored[-1][1] - 1.0
    scored += [(char, rarest) for char in _ALPHABET if char not in known]
    return [
        *((special, 0.0) for special in specials),
        *scored,
        *((f"<extra_id_{i}>", 0.0) for i in reversed(range(T5_EXTRA_IDS))),
    ]


def t5_tokenizer() -> Any:
    """A `T5TokenizerFast` over `t5_unigram_pieces()`: appends `</s>`, pads with `<pad>`."""
    # transformers 5 exports the name lazily, as an alias of its tokenizers-backed T5Tokenizer.
    from transformers import T5TokenizerFast  # type: ignore[attr-defined]

    return T5TokenizerFast(
        vocab=t5_unigram_pieces(),
        extra_ids=T5_EXTRA_IDS,
        model_max_length=T5_MAX_TOKENS,
    )


def qwen_bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE learnt by the `tokenizers` BPE trainer, pre-tokenized as Qwen2's is.

    The byte alphabet comes first, then the learnt merges; the special tokens are appended by
    `qwen_tokenizer` after them, as Qwen's own take the ids after its 151643 regular tokens.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=_QWEN_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(SENTENCES), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = {str(token): int(index) for token, index in model["vocab"].items()}
    merges = [(str(a), str(b)) for a, b in model["merges"]]
    return vocab, merges


def qwen_tokenizer() -> Any:
    """A `Qwen2TokenizerFast` with Qwen3's special tokens and chat template.

    As in Qwen3's tokenizer: `<|endoftext|>` pads, `<|im_end|>` ends a turn (the eos token),
    no bos token, `<think>` and `</think>` are single (non-special) added tokens.
    """
    from tokenizers import AddedToken
    from transformers import Qwen2TokenizerFast  # type: ignore[attr-defined]  # as T5's

    vocab, merges = qwen_bpe_vocab_and_merges()
    for token in (QWEN_PAD, QWEN_IM_START, QWEN_IM_END, *QWEN_THINK):
        vocab[token] = len(vocab)
    tokenizer = Qwen2TokenizerFast(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=QWEN_IM_END,
        pad_token=QWEN_PAD,
        additional_special_tokens=[QWEN_IM_START, QWEN_IM_END],
        model_max_length=_QWEN_MAX_TOKENS,
    )
    tokenizer.add_tokens(
        [AddedToken(token, special=False, normalized=False) for token in QWEN_THINK]
    )
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer
