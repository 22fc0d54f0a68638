"""Differential fuzzing of the safetensors reader against the reference (``safetensors``).

Valid files (written by tdfunc, or raw with random layouts, dtypes, names and metadata) are
mutated at the byte and JSON level: header length off by a few bytes, repeated names, byte
order marks and UTF-16, unpaired surrogates, deep nesting, shifted offsets, holes, overlaps,
trailing bytes, zero-element tensors with huge dims, bad dtypes, metadata of the wrong type,
numbers out of range. Each file is loaded by tdfunc (``structure="flat"``) and by
``safetensors.torch.load_file``; both must accept it with the same names, dtypes, shapes and
bytes, or both must refuse it (tdfunc with a ``SafetensorsFormatError`` naming the file). The
one allowed difference: a name repeated in one object of the header, which tdfunc refuses and
the reference resolves by keeping the last one. Files tdfunc wrote are loaded with their
structure too (``structure="auto"``, after edits of the structure and of tied copies): each
leaf must then be the tensor its key path names, or the load is refused.

``make test`` runs a few hundred files; ``TDFUNC_SAFETENSORS_FUZZ_EXAMPLES`` sets the count
(``make fuzz`` runs thousands), ``TDFUNC_SAFETENSORS_FUZZ_SEED`` the seed.
"""

from __future__ import annotations

import json
import os
import random
import struct
from collections import Counter
from typing import Any

import pytest
import torch

import tdfunc
from tdfunc import SafetensorsFormatError, TensorDict, load_safetensors, save_safetensors
from tdfunc.interop import _errors as E

safetensors_torch = pytest.importorskip("safetensors.torch")

EXAMPLES = int(os.environ.get("TDFUNC_SAFETENSORS_FUZZ_EXAMPLES", "300"))
SEED = int(os.environ.get("TDFUNC_SAFETENSORS_FUZZ_SEED", "20261201"))

#: dtype name -> bits per value (every name of the format that torch has a type for)
BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
    "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64, "F4": 4,
}  # fmt: skip
NAMES = ["a", "b", "w.x", "emb.weight", "head.weight", "é", "日本", "a b", "", "x\x00", "n.m.k"]
SHAPES = [[], [0], [3], [2, 4], [1, 0, 5], [4, 1], [2, 2, 2]]


class Obj(list):  # type: ignore[type-arg]
    """A JSON object as a list of ``[name, value]`` pairs: names may repeat."""


def dumps(v: Any, ascii_only: bool = True) -> str:
    if isinstance(v, Obj):
        inner = ",".join(f"{dumps(k, ascii_only)}:{dumps(x, ascii_only)}" for k, x in v)
        return "{" + inner + "}"
    if isinstance(v, list):
        return "[" + ",".join(dumps(x, ascii_only) for x in v) + "]"
    if isinstance(v, Raw):
        return v.text
    return json.dumps(v, ensure_ascii=ascii_only)


class Raw:
    """JSON text written as it is (numbers Python's json would not write)."""

    def __init__(self, text: str) -> None:
        self.text = text


def as_obj(v: Any) -> Any:
    if isinstance(v, dict):
        return Obj([k, as_obj(x)] for k, x in v.items())
    if isinstance(v, list):
        return [as_obj(x) for x in v]
    return v


def get(o: Obj, k: str) -> Any:
    return next((v for n, v in o if n == k), None)


def put(o: Obj, k: str, v: Any) -> None:
    for p in o:
        if p[0] == k:
            p[1] = v
            return
    o.append([k, v])


# ---------------------------------------------------------------------------- valid files
def raw_file(rng: random.Random) -> tuple[Obj, bytes]:
    """A valid file: random tensors laid out in a random order, random metadata."""
    names = rng.sample(NAMES, rng.randint(0, 4))
    infos = []
    for name in names:
        dname = rng.choice(list(BITS))
        shape = list(rng.choice(SHAPES))
        if dname == "F4":
            shape = [*shape, 2] if not shape or shape[-1] % 2 else shape
        n = 1
        for s in shape:
            n *= s
        infos.append([name, dname, shape, n * BITS[dname] // 8])
    data = bytearray()
    offsets = {}
    for name, _, _, nb in rng.sample(infos, len(infos)):
        offsets[name] = [len(data), len(data) + nb]
        data += rng.randbytes(nb)
    header = Obj(
        [name, Obj([["dtype", d], ["shape", s], ["data_offsets", offsets[name]]])]
        for name, d, s, _ in infos
    )
    r = rng.random()
    if r < 0.6:
        meta = as_obj(rng.choice([{}, {"format": "pt"}, {"k": "v", "é": "ü"}]))
        header.insert(rng.randint(0, len(header)), ["__metadata__", meta])
    elif r < 0.7:
        header.insert(0, ["__metadata__", None])
    return header, bytes(data)


def tdfunc_file(rng: random.Random, path: str) -> tuple[Obj, bytes]:
    """A file tdfunc wrote: nested, batched, sometimes with a tied leaf."""
    w = torch.randn(3, 2)
    td = TensorDict(
        a=torch.randint(0, 9, (3, 4), dtype=rng.choice([torch.int64, torch.uint8])),
        n={"b": torch.randn(3).half(), "e": torch.zeros(3, 0)},
        emb={"weight": w},
        batch_size=[3],
    )
    if rng.random() < 0.5:
        td = td.set("head", TensorDict(weight=w, batch_size=[3]))
    save_safetensors(td, path, overwrite=True)
    with open(path, "rb") as fh:
        raw = fh.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return as_obj(json.loads(raw[8 : 8 + n])), raw[8 + n :]


# ---------------------------------------------------------------------------- mutations
def pair(o: Any) -> bool:
    """Whether ``o`` is a pair of plain integer offsets."""
    return is_array(o) and len(o) == 2 and all(type(x) is int for x in o)


def is_array(v: Any) -> bool:
    return type(v) is list  # an Obj is a list too, of pairs


def tensors(h: Obj) -> list[list[Any]]:
    return [p for p in h if p[0] != "__metadata__" and isinstance(p[1], Obj)]


def m_duplicate(rng: random.Random, h: Obj, data: bytes) -> bytes:
    ts = tensors(h)
    kind = rng.choice(["same", "other", "meta", "field", "metakey"])
    if kind == "same" and ts:
        p = rng.choice(ts)
        h.insert(rng.randint(0, len(h)), [p[0], Obj([list(q) for q in p[1]])])
    elif kind == "other" and len(ts) > 1:
        a, b = rng.sample(ts, 2)
        h.insert(rng.randint(0, len(h)), [a[0], b[1]])
    elif kind == "meta":
        h.insert(rng.randint(0, len(h)), ["__metadata__", Obj([["x", "y"]])])
        h.insert(rng.randint(0, len(h)), ["__metadata__", Obj([["x", "z"]])])
    elif kind == "field" and any(x for _, x in ts):
        e = rng.choice([x for _, x in ts if x])
        e.insert(rng.randint(0, len(e)), list(rng.choice(e)))
    else:
        h.insert(0, ["__metadata__", Obj([["k", "1"], ["k", "2"]])])
    return data


def m_surrogate(rng: random.Random, h: Obj, data: bytes) -> bytes:
    text = rng.choice(["\ud800", "\udc00", "x\udbff", "\ud83d\ude00", "\ud83d"])
    ts = tensors(h)
    where = rng.choice(["name", "meta", "field"])
    if where == "name" and ts:
        rng.choice(ts)[0] += text
    elif where == "field" and ts:
        rng.choice(ts)[1].append(["note", text])
    else:
        h.insert(0, ["__metadata__", Obj([["k", text]])])
    return data


def nest(depth: int, obj: bool) -> Raw:
    if obj:
        return Raw('{"k":' * depth + "1" + "}" * depth)
    return Raw("[" * depth + "1" + "]" * depth)


def m_deep(rng: random.Random, h: Obj, data: bytes) -> bytes:
    depth = rng.choice([1, 60, 123, 124, 125, 126, 127, 200, 1000, 5000])
    ts = tensors(h)
    if ts:
        rng.choice(ts)[1].append(["x", nest(depth, rng.random() < 0.5)])
    else:
        h.append(["__metadata__", nest(depth, True)])
    return data


def m_offsets(rng: random.Random, h: Obj, data: bytes) -> bytes:
    ts = tensors(h)
    kind = rng.choice(["shift", "begin", "end", "hole", "overlap", "trailing", "cut", "swap"])
    if kind == "trailing" or not ts:
        return data + rng.randbytes(rng.randint(1, 9))
    if kind == "cut":
        return data[: max(0, len(data) - rng.randint(1, 9))]
    e = rng.choice(ts)[1]
    offs = get(e, "data_offsets")
    if not pair(offs):
        return data
    k = rng.choice([-9, -8, -4, -2, -1, 1, 2, 4, 8])
    if kind == "shift":
        put(e, "data_offsets", [max(0, offs[0] + k), max(0, offs[1] + k)])
    elif kind == "begin":
        put(e, "data_offsets", [max(0, offs[0] + k), offs[1]])
    elif kind == "end":
        put(e, "data_offsets", [offs[0], max(0, offs[1] + k)])
    elif kind == "hole":  # bytes no tensor covers, the later tensors moved behind them
        gap = rng.randint(1, 8)
        for _, x in ts:
            o = get(x, "data_offsets")
            if pair(o) and o[0] >= offs[0]:
                put(x, "data_offsets", [o[0] + gap, o[1] + gap])
        return data[: offs[0]] + rng.randbytes(gap) + data[offs[0] :]
    elif kind == "overlap":
        put(e, "data_offsets", [max(0, offs[0] - 1), offs[1] - 1 if offs[1] else 0])
    else:
        put(e, "data_offsets", [offs[1], offs[0]])
    return data


def m_zero_dims(rng: random.Random, h: Obj, data: bytes) -> bytes:
    big = rng.choice([2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70])
    shape = rng.choice([[0, big], [0, big, big], [big, big, 0], [big, 0], [2, big, 0], [0]])
    ends = [0, len(data), rng.randint(0, len(data))]
    for _, e in tensors(h):
        o = get(e, "data_offsets")
        if pair(o):
            ends.extend(o)
    at = rng.choice(ends)
    dname = rng.choice(["F32", "U8", "F4", "C64"])
    info = Obj([["dtype", dname], ["shape", shape], ["data_offsets", [at, at]]])
    h.insert(rng.randint(0, len(h)), [f"zero{len(h)}", info])
    return data


def m_dtype(rng: random.Random, h: Obj, data: bytes) -> bytes:
    ts = tensors(h)
    if not ts:
        return data
    e = rng.choice(ts)[1]
    choices: list[Any] = ["u8", "F6_E2M3", "F6_E3M2", "X9", "", 5, None, ["U8"]]
    choices += [Obj([["U8", None]]), Obj([["U8", 1]]), Obj([["U8", None], ["I8", None]])]
    choices += list(BITS)
    put(e, "dtype", rng.choice(choices))
    return data


def m_metadata(rng: random.Random, h: Obj, data: bytes) -> bytes:
    choices: list[Any] = [None, Obj(), Obj([["a", 1]]), Obj([["a", None]]), [], "x", 3]
    choices += [Obj([["a", Obj([["b", "c"]])]]), Obj([["a", ["b"]]]), Obj([["a", True]])]
    h[:] = [p for p in h if p[0] != "__metadata__"]
    h.insert(rng.randint(0, len(h)), ["__metadata__", rng.choice(choices)])
    return data


def m_numbers(rng: random.Random, h: Obj, data: bytes) -> bytes:
    ts = tensors(h)
    if not ts:
        return data
    e = rng.choice(ts)[1]
    odd = [Raw(t) for t in ["8.0", "-0", "1e0", "1E2", "-1", "1e400", "-1e400", "1e-400"]]
    odd += [Raw(t) for t in ["NaN", "Infinity", "-Infinity", "1" * 30, "-" + "9" * 25]]
    odd += [Raw("1" * 500), True, "8", 2**64, 2**64 - 1, None]
    kind = rng.choice(["shape", "offset", "extra"])
    if kind == "shape":
        s = get(e, "shape")
        if is_array(s) and s:
            s[rng.randrange(len(s))] = rng.choice(odd)
        else:
            put(e, "shape", [rng.choice(odd)])
    elif kind == "offset":
        o = get(e, "data_offsets")
        if is_array(o) and o:
            o[rng.randrange(len(o))] = rng.choice(odd)
    else:
        e.append(["extra", rng.choice(odd)])
    return data


def m_fields(rng: random.Random, h: Obj, data: bytes) -> bytes:
    ts = tensors(h)
    kind = rng.choice(["missing", "extra", "entry", "top", "shape", "offsets", "names"])
    if kind == "top":
        h[:] = []
        h.append(["__top__", rng.choice([[], "x", 3, None])])
        return data
    if not ts:
        return data
    p = rng.choice(ts)
    e = p[1]
    if kind == "missing":
        field = rng.choice(["dtype", "shape", "data_offsets"])
        e[:] = [q for q in e if q[0] != field]
    elif kind == "extra":
        e.insert(rng.randint(0, len(e)), [rng.choice(["x", "__metadata__", "dtype2"]), "v"])
    elif kind == "entry":
        p[1] = rng.choice([5, "x", [], None, Obj()])
    elif kind == "shape":
        s = get(e, "shape")
        if is_array(s) and s and type(s[0]) is int:
            s[0] = max(0, s[0] + rng.choice([-1, 1, 2]))
        elif is_array(s):
            s.append(rng.choice([0, 1, 2]))
    elif kind == "offsets":
        o = get(e, "data_offsets")
        if pair(o):
            put(e, "data_offsets", rng.choice([o[:1], [*o, o[1]], Obj([["0", o[0]]]), "0"]))
    else:
        p[0] = rng.choice(["", "__metadata__", p[0] + "\x01", p[0] + "\u2028"])
    return data


JSON_MUTATIONS = [
    m_duplicate, m_surrogate, m_deep, m_offsets, m_zero_dims, m_dtype, m_metadata, m_numbers,
    m_fields,
]  # fmt: skip


def serialise(rng: random.Random, h: Obj, data: bytes) -> bytes:
    ascii_only = rng.random() < 0.5
    text = dumps(h, ascii_only)
    raw = text.encode("utf-8", "surrogatepass")  # a raw surrogate stays invalid UTF-8
    if rng.random() < 0.7:
        raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def b_length(rng: random.Random, raw: bytes) -> bytes:
    (n,) = struct.unpack("<Q", raw[:8])
    n = rng.choice([n + k for k in (-9, -8, -2, -1, 1, 2, 8)] + [0, 100_000_001, 2**63, 2**64 - 1])
    return struct.pack("<Q", max(0, min(n, 2**64 - 1))) + raw[8:]


def b_encoding(rng: random.Random, raw: bytes) -> bytes:
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = raw[8 : 8 + n], raw[8 + n :]
    kind = rng.choice(["bom", "utf-16", "utf-16-le", "utf-32", "latin-1"])
    if kind == "bom":
        header = b"\xef\xbb\xbf" + header
    else:
        try:
            header = header.decode("utf-8").encode(kind)
        except (UnicodeError, ValueError):
            header = b"\xff" + header
    return struct.pack("<Q", len(header)) + header + data


def b_whitespace(rng: random.Random, raw: bytes) -> bytes:
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = raw[8 : 8 + n], raw[8 + n :]
    pad = rng.choice([b" ", b"\t", b"\n\r", b"\x0c", b"\x00", b"\xc2\xa0", b"\x0b"])
    header = pad + header if rng.random() < 0.5 else header + pad
    if rng.random() < 0.3:
        header = header.replace(b"}", b",}", 1)
    return struct.pack("<Q", len(header)) + header + data


def b_bytes(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    if rng.random() < 0.5 and len(b) > 8:
        i = rng.randrange(8, len(b))
        b[i] = rng.randrange(256)
        return bytes(b)
    return bytes(b[: rng.randrange(len(b) + 1)])


BYTE_MUTATIONS = [b_length, b_encoding, b_whitespace, b_bytes]


# ---------------------------------------------------------------------------- structure edits
def s_edit(rng: random.Random, h: Obj, data: bytes) -> bytes:
    """Edit tdfunc's structure entry, or the bytes of one tensor (e.g. a tied copy)."""
    ts = tensors(h)
    meta = next((v for k, v in h if k == "__metadata__" and isinstance(v, Obj)), None)
    kind = rng.choice(["swap", "rename", "repeat", "tie", "data", "version"])
    if kind == "data" and ts:
        o = get(rng.choice(ts)[1], "data_offsets")
        if o[1] > o[0]:
            i = rng.randrange(o[0], o[1])
            return data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1 :]
        return data
    if meta is None:
        return data
    desc = json.loads(get(meta, "tdfunc"))
    leaves = []
    stack = [desc["root"]]
    while stack:
        node = stack.pop()
        for item in node.get("children", []):
            if "leaf" in item[1]:
                leaves.append(item)
            elif "children" in item[1]:
                stack.append(item[1])
    if kind == "swap" and len(leaves) > 1:
        a, b = rng.sample(leaves, 2)
        a[1]["leaf"], b[1]["leaf"] = b[1]["leaf"], a[1]["leaf"]
    elif kind == "rename" and leaves:
        rng.choice(leaves)[0] = "renamed"
    elif kind == "repeat" and leaves:
        a = rng.choice(leaves)
        desc["root"]["children"].append(["again", dict(a[1])])
    elif kind == "tie" and len(leaves) > 1:
        a, b = rng.sample(leaves, 2)
        b[1]["tie"] = a[1]["leaf"]
    elif kind == "version":
        desc["version"] = rng.choice([0, 2, "1", None])
    put(meta, "tdfunc", json.dumps(desc))
    return data


# ---------------------------------------------------------------------------- the oracle
def reference(path: str) -> dict[str, torch.Tensor] | BaseException:
    try:
        return safetensors_torch.load_file(path)
    except Exception as e:  # any refusal of the reference
        return e


def mine(path: str, structure: str = "flat") -> Any:
    try:
        return load_safetensors(path, structure=structure)
    except Exception as e:  # judged by the caller: only SafetensorsFormatError is right
        return e


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    x = a.reshape(-1).view(torch.uint8)
    y = torch.as_tensor(b).reshape(-1).view(torch.uint8)
    return torch.equal(x, y)


def has_repeated_name(raw: bytes) -> bool:
    """Whether some object of the header gives a name twice (read with Python's json)."""
    found = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        names = [k for k, _ in items]
        if len(set(names)) < len(names):
            found.append(True)
        return dict(items)

    try:
        (n,) = struct.unpack("<Q", raw[:8])
        json.loads(raw[8 : 8 + n].decode("utf-8"), object_pairs_hook=pairs)
    except (ValueError, RecursionError, struct.error):
        return False
    return bool(found)


def compare(path: str, raw: bytes) -> tuple[str, str]:
    """``(outcome, problem)``: outcome ``accept``/``refuse``/``duplicate``; problem empty if
    tdfunc and the reference agree."""
    theirs = reference(path)
    ours = mine(path)
    if isinstance(ours, Exception) and not isinstance(ours, SafetensorsFormatError):
        return "refuse", f"tdfunc raised {type(ours).__name__}: {ours}"[:400]
    if isinstance(ours, SafetensorsFormatError):
        if repr(path) not in str(ours):
            return "refuse", f"the error does not name the file: {ours}"
        if isinstance(theirs, BaseException):
            return "refuse", ""
        if E.HEADER_DUPLICATE.split("{")[0] in str(ours) and has_repeated_name(raw):
            return "duplicate", ""
        return "refuse", f"tdfunc refuses, the reference accepts: {ours}"
    if isinstance(theirs, BaseException):
        return "accept", f"tdfunc accepts, the reference refuses: {theirs!r}"[:400]
    if set(theirs) != set(ours.keys()):
        return "accept", f"names differ: {sorted(theirs)} vs {sorted(ours.keys())}"
    for k, v in theirs.items():
        if not same_bytes(v, ours[k]):
            return "accept", f"tensor {k!r} differs: {v.dtype}{tuple(v.shape)} vs {ours[k]!r}"
    return "accept", ""


def check_structure(path: str) -> str:
    """With its structure, every leaf is the tensor its key path names (or a refusal)."""
    flat = mine(path)
    if isinstance(flat, BaseException):
        return ""
    td = mine(path, "auto")
    if isinstance(td, SafetensorsFormatError) or (
        isinstance(td, TypeError) and "defined in this process" in str(td)  # a type name edited
    ):
        return "" if repr(path) in str(td) else f"the error does not name the file: {td}"
    if isinstance(td, Exception):
        return f"tdfunc raised {type(td).__name__}: {td}"[:400]
    names = set(flat.keys())
    for key, leaf in td.items(include_nested=True, leaves_only=True):
        name = ".".join(key if isinstance(key, tuple) else (key,))
        if name not in names or not same_bytes(flat[name], leaf):
            return f"key {key} does not hold the tensor {name!r}"
    return ""


def one_case(rng: random.Random, path: str) -> tuple[str, str, str]:
    """Make one file at ``path``; ``(label, outcome, problem)``."""
    ours = rng.random() < 0.3
    h, data = tdfunc_file(rng, path) if ours else raw_file(rng)
    labels = []
    if ours and rng.random() < 0.5:
        data = s_edit(rng, h, data)
        labels.append("structure")
    for _ in range(rng.choice([0, 1, 1, 1, 2])):
        m = rng.choice(JSON_MUTATIONS)
        data = m(rng, h, data)
        labels.append(m.__name__)
    raw = serialise(rng, h, data)
    if rng.random() < 0.25:
        b = rng.choice(BYTE_MUTATIONS)
        raw = b(rng, raw)
        labels.append(b.__name__)
    with open(path, "wb") as fh:
        fh.write(raw)
    outcome, problem = compare(path, raw)
    if not problem and ours:
        problem = check_structure(path)
    return "+".join(labels) or "valid", outcome, problem


def run(n: int, seed: int, directory: str) -> tuple[Counter[str], list[str]]:
    """Fuzz ``n`` files; the outcome counts and the disagreements (with their seeds)."""
    counts: Counter[str] = Counter()
    problems = []
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        path = os.path.join(directory, f"f{i}.safetensors")
        label, outcome, problem = one_case(rng, path)
        counts[outcome] += 1
        if problem:
            problems.append(f"case {i} (seed {seed}, {label}): {problem}")
        os.unlink(path)
    return counts, problems


def test_reader_agrees_with_the_reference(tmp_path):
    counts, problems = run(EXAMPLES, SEED, str(tmp_path))
    assert not problems, f"{len(problems)} disagreements of {EXAMPLES} files:\n" + "\n".join(
        problems[:10]
    )
    # the corpus exercises both sides: valid files, refused files and repeated names
    assert counts["accept"] > EXAMPLES // 10
    assert counts["refuse"] > EXAMPLES // 10


def test_fuzzer_finds_what_the_reference_refuses(tmp_path):
    """The oracle comparison itself: a file with a hole is refused by both readers."""
    path = str(tmp_path / "hole.safetensors")
    h = Obj([["a", Obj([["dtype", "U8"], ["shape", [2]], ["data_offsets", [1, 3]]])]])
    raw = struct.pack("<Q", 56) + dumps(h).encode().ljust(56) + b"xyz"
    with open(path, "wb") as fh:
        fh.write(raw)
    assert isinstance(reference(path), BaseException)
    assert compare(path, raw) == ("refuse", "")
    assert tdfunc.SafetensorsFormatError is SafetensorsFormatError
