"""Training the byte-level BPE tokenizer of ``make-model`` checkpoints, offline.

Nothing can be downloaded, so the corpus is generated here, deterministically, from word
lists: English-like sentences, numbers, punctuation, code-ish snippets, chat-ish turns and a
little non-ASCII text. That is enough text for a few thousand merges; when a preset asks for
more than the corpus can fill, the trainer stops early and the model's embedding rows past the
tokenizer's last id are padding (never produced by the tokenizer).
"""

from __future__ import annotations

import json
import random
from typing import Any

from kvtier.errors import InvalidArgumentError
from kvtier.models.chat_template import get_format

_NOUNS = ["time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company", "system", "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others", "level", "office", "door", "health", "person", "art", "war", "history", "party", "result", "change", "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education", "cache", "memory", "token", "model", "server", "request", "session", "layer", "block", "chunk", "disk", "network", "tier", "policy", "cost", "latency", "bandwidth", "queue", "buffer", "kernel", "tensor", "batch", "user", "message", "answer"]
_VERBS = ["is", "was", "has", "had", "does", "said", "goes", "gets", "makes", "knows", "thinks", "takes", "sees", "comes", "wants", "looks", "uses", "finds", "gives", "tells", "works", "calls", "tries", "asks", "needs", "feels", "becomes", "leaves", "puts", "means", "keeps", "lets", "begins", "seems", "helps", "talks", "turns", "starts", "shows", "hears", "plays", "runs", "moves", "likes", "lives", "believes", "holds", "brings", "happens", "writes", "provides", "sits", "stands", "loses", "pays", "meets", "includes", "continues", "sets", "learns", "changes", "leads", "understands", "watches", "follows", "stops", "creates", "speaks", "reads", "allows", "adds", "spends", "grows", "opens", "walks", "wins", "offers", "remembers", "loves", "considers", "appears", "buys", "waits", "serves", "stores", "loads", "evicts", "restores", "computes", "offloads", "caches", "streams", "sends", "returns"]
_ADJS = ["good", "new", "first", "last", "long", "great", "little", "own", "other", "old", "right", "big", "high", "different", "small", "large", "next", "early", "young", "important", "few", "public", "bad", "same", "able", "free", "full", "fast", "slow", "cold", "warm", "hot", "real", "best", "better", "sure", "clear", "recent", "certain", "whole", "simple", "easy", "hard", "strong", "short", "local", "quick", "quiet", "bright", "dark", "open", "busy", "idle", "empty", "ready", "safe", "random", "tiny", "huge"]
_ADVS = ["quickly", "slowly", "often", "never", "always", "sometimes", "really", "quite", "very", "almost", "soon", "again"]
_PREPS = ["in", "on", "at", "with", "from", "into", "over", "under", "after", "before", "between", "through", "about", "for", "to", "of"]
_DETS = ["the", "a", "this", "that", "every", "some", "each", "my", "your", "our", "their", "one", "no", "any"]
_NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Oscar", "Peggy", "Trent"]
_CODE_WORDS = ["x", "y", "i", "n", "idx", "buf", "key", "value", "size", "count", "total", "result", "data", "items", "node", "cfg"]
_UNICODE = [
    "café", "naïve", "über", "façade", "jalapeño", "Ångström", "Straße", "résumé",
    "日本語", "中文", "한국어", "Привет", "γειά", "שלום", "مرحبا", "emoji 🙂", "🚀 launch",
    "👍🏽", "❤️", "€5", "£10", "±3", "½", "→", "…", "—",
]


_ONSETS = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "br", "cl", "dr", "fl", "gr", "pl", "st", "tr", "sh", "ch", "th"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck"]


def _pseudo_word(rng: random.Random) -> str:
    """A pronounceable made-up word: variety for the merges beyond the word lists."""
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
        for _ in range(rng.randint(1, 3))
    )


def _sentence(rng: random.Random) -> str:
    noun = _pseudo_word(rng) if rng.random() < 0.5 else rng.choice(_NOUNS)
    words = [rng.choice(_DETS), rng.choice(_ADJS), noun, rng.choice(_VERBS)]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADVS))
    words += [rng.choice(_PREPS), rng.choice(_DETS), rng.choice(_NOUNS)]
    if rng.random() < 0.3:
        words += ["and", rng.choice(_NAMES), rng.choice(_VERBS), rng.choice(_NOUNS)]
    if rng.random() < 0.15:
        words.insert(rng.randrange(len(words)), rng.choice(_UNICODE))
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randrange(100000)))
    text = " ".join(words)
    end = rng.choice(".....!?;")
    return text[0].upper() + text[1:] + end


def _code(rng: random.Random) -> str:
    a, b = rng.choice(_CODE_WORDS), rng.choice(_CODE_WORDS)
    n = rng.randrange(1000)
    forms = [
        f"def {a}_{b}({a}, {b}={n}):\n    return {a} + {b}\n",
        f"for {a} in range({n}):\n    {b}[{a}] = {a} * 2\n",
        f"if {a} >= {n} and not {b}:\n    raise ValueError(\"{a} too big\")\n",
        f"{a} = {{\"{b}\": {n}, \"ok\": true}}\n",
        f"int {a}[{n}]; {b} += {a}[i] << 2; // {rng.choice(_NOUNS)}\n",
        f"$ kvtier {rng.choice(_NOUNS)} --{a} {n} > out/{b}.json\n",
    ]
    return rng.choice(forms)


def generate_corpus(seed: int = 0, approx_bytes: int = 300_000) -> list[str]:
    """Deterministic training text (a list of documents) of about ``approx_bytes``."""
    rng = random.Random(seed)
    docs: list[str] = []
    size = 0
    while size < approx_bytes:
        r = rng.random()
        if r < 0.65:
            doc = " ".join(_sentence(rng) for _ in range(rng.randint(1, 5)))
        elif r < 0.85:
            doc = "".join(_code(rng) for _ in range(rng.randint(1, 3)))
        elif r < 0.95:
            doc = f"{rng.choice(_NAMES)}: {_sentence(rng)}\n{rng.choice(_NAMES)}: {_sentence(rng)}"
        else:
            nums = [str(rng.randrange(10 ** rng.randint(1, 9))) for _ in range(rng.randint(2, 8))]
            doc = ", ".join(nums) + f" ({rng.random():.4f})"
        docs.append(doc)
        size += len(doc.encode())
    return docs


_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
PRETOKENIZERS = ("gpt2", "llama3", "qwen2")


def _pre_tokenizer(style: str) -> Any:
    """The real models' splits: GPT-2's byte-level regex, or Llama 3's / Qwen2's Split."""
    from tokenizers import Regex, pre_tokenizers

    if style == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if style not in PRETOKENIZERS:
        raise InvalidArgumentError(f"unknown pre-tokenizer {style!r}; use one of {PRETOKENIZERS}")
    pattern = _LLAMA3_SPLIT if style == "llama3" else _QWEN2_SPLIT
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def train_tokenizer(family: str, vocab_size: int, pretokenizer: str = "gpt2", seed: int = 0) -> str:
    """Train a byte-level BPE for chat ``family``; returns the ``tokenizer.json`` text.

    Special tokens take the first ids, then the 256 byte symbols, then the merges. Training
    is deterministic: the same arguments give the same text (a test checks it).
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    fmt = get_format(family)
    specials = list(fmt.special_tokens)
    min_size = len(specials) + 256 + 1
    if vocab_size < min_size:
        raise InvalidArgumentError(
            f"vocab size {vocab_size} is too small for a byte-level BPE with "
            f"{len(specials)} special tokens; use at least {min_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer(pretokenizer)
    if pretokenizer == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(seed), trainer=trainer)
    if fmt.bos_token is not None and fmt.add_bos:
        bos = fmt.bos_token
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Canonical JSON (sorted keys, fixed indent) so equal tokenizers are equal bytes.
    return json.dumps(json.loads(tok.to_str()), indent=2, ensure_ascii=False, sort_keys=True)
