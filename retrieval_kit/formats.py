"""Reading users' files: lines of plain or gzipped UTF-8, the field's training formats, BEIR folders,
and the validators every entry point shares.

Training formats, told per file by the first record's fields (records.read_records says which):
    NeMo inline            {"query"|"question", "pos_doc", "neg_doc"}; a doc is a string or {"id", "text"}
    FlagEmbedding          {"query", "pos", "neg", "pos_scores"?, "neg_scores"?, "prompt"?}
    sentence-transformers  {"anchor"|"query", "positive", "negative" | "negative_1".."negative_n"}
    Tevatron               {"query", "positive_passages", "negative_passages"}, passages {docid, title, text}
With a corpus (--corpus, a BEIR corpus.jsonl), a NeMo doc that is a string or {"id"} is an id into
it, and so is a Tevatron passage without text (its docid). Teacher scores (`pos_scores`,
`neg_scores`) and prompts work in the NeMo and FlagEmbedding formats.

Every bad line is reported as `file:line: problem`, all of them at once: a text must be a string with
at least one visible character and valid Unicode (no unpaired surrogate); an id a non-empty string.
"""

import contextlib
import gc
import json
import math
import re
import unicodedata


class DataError(ValueError):
    """Raised with one `file:line: problem` per bad line."""


def file_digest(path):
    """A content fingerprint of a file: blake2b-128 of all its bytes (hex), for a resume to notice data
    regenerated under the same path and size (datacache.file_digest, which keys the data cache too)."""
    from .datacache import file_digest as digest

    return digest(path)


def format_problems(problems, limit=50):
    shown = problems[:limit]
    more = f"\n... and {len(problems) - limit} more" if len(problems) > limit else ""
    return "\n".join(shown) + more


def raise_problems(path, problems):
    if problems:
        raise DataError(f"{len(problems)} problem(s) in {path}:\n" + format_problems(problems))


GZIP_MAGIC = b"\x1f\x8b"


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector off meanwhile (as a decorator: while the function runs). A parse
    makes millions of small objects that form no cycles, and each collection would rescan every live
    object of the process: 27% of the time of a 100k-record load with torch imported."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def text_lines(path, problems):
    """Yield (lineno, text) for every line of a UTF-8 text file, plain or gzip-compressed (told by
    its first bytes, whatever its name). A line that is not valid UTF-8 is reported in `problems`
    as `path:line` and skipped, so every bad line of the file is reported at once; a byte-order
    mark at the start is dropped. A file that cannot be opened, or a truncated or corrupt gzip
    stream, is a DataError naming the file."""
    import gzip
    import zlib

    try:
        with open(path, "rb") as f:
            head = f.read(4)
        compressed = head[:2] == GZIP_MAGIC
        f = gzip.open(path, "rb") if compressed else open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror})") from None
    if head == b"PAR1":
        f.close()
        raise DataError(f"{path}: a Parquet file, not text: write it as JSON Lines first, e.g. "
                        f"pandas.read_parquet({path!r}).to_json('out.jsonl', orient='records', lines=True)")
    lineno = 0
    with f:
        try:
            for lineno, raw in enumerate(f, start=1):
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                try:
                    yield lineno, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    problems.append(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} "
                                    "of the line); re-encode the file as UTF-8")
        except (EOFError, OSError, zlib.error) as e:
            raise DataError(f"{path}: the gzip stream is truncated or corrupt after line {lineno} ({e})") from None


def jsonl_objects(path, problems):
    """Yield (lineno, dict) for each non-blank line of a JSONL file that is a JSON object; every
    other line is a problem (text_lines for the bytes). A file that is another format altogether
    (one JSON array, CSV or TSV) is one DataError saying so, not a problem on every line."""
    first = True
    for lineno, line in text_lines(path, problems):
        if not line.strip():
            continue
        if first:
            first = False
            _check_is_jsonl(path, line)
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})")
            continue
        except RecursionError:
            problems.append(f"{path}:{lineno}: invalid JSON (nested too deeply)")
            continue
        if not isinstance(obj, dict):
            problems.append(f"{path}:{lineno}: expected a JSON object, got {json_type(obj)}")
            continue
        yield lineno, obj


def _check_is_jsonl(path, first_line):
    """The first non-blank line of a file read as JSON Lines: one JSON array, or a CSV / TSV header,
    is named as such (a DataError with how to convert it)."""
    text = first_line.strip()
    if text.startswith("["):
        raise DataError(f"{path}: one JSON array, not JSON Lines (one object per line): convert it, e.g. "
                        f"jq -c '.[]' {path} > out.jsonl")
    if text.startswith("{") or any(c in text for c in '{}":'):  # a JSON object, broken or not: its own problem
        return
    for sep, name in (("\t", "TSV"), (",", "CSV")):
        if sep in text:
            columns = [c.strip().strip('"') for c in text.split(sep)][:6]
            raise DataError(f"{path}: a {name} file (first line: {', '.join(columns)}), not JSON Lines: convert it, "
                            f"e.g. pandas.read_csv({path!r}{', sep=chr(9)' if sep == chr(9) else ''}).to_json("
                            "'out.jsonl', orient='records', lines=True)")


# ----- validators ----------------------------------------------------------------------------------

def json_type(value):
    return {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _visible(text):
    """Has a character that is not a space, a control or a format character (zero-width space, BOM...)."""
    if text[:1].isalnum():  # a letter or a digit first (category L or N): the common case, decided at once
        return True
    for c in text:
        if unicodedata.category(c)[0] not in "CZ":
            return True
    return False


def plain_text(value):
    """A string that text_problem passes at a glance: ASCII (no surrogates) starting with a letter or
    a digit (visible). False says only "look closer"."""
    return type(value) is str and value.isascii() and value[:1].isalnum()


def text_problem(value):
    """Why `value` cannot be a query or passage text, or None when it can."""
    if not isinstance(value, str):
        return f"must be a string, got {json_type(value)}"
    try:
        if not value.isascii():  # (constant time in CPython) ASCII text has no surrogates to find
            value.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"has an unpaired surrogate \\u{ord(value[e.start]):04x} (not valid Unicode)"
    if not _visible(value):
        return "is empty or only spaces and control characters" if value else "is an empty string"
    return None


def id_problem(value):
    """Why `value` cannot be a document or query id, or None: the same rules as a text."""
    return text_problem(value)


def check(problem_fn, value, where, what, problems):
    """value if problem_fn finds nothing wrong with it, else None with `where: what <problem>` added."""
    p = problem_fn(value)
    if p:
        problems.append(f"{where}: {what} {p}")
        return None
    return value


def _scores(obj, name, n_docs, where, problems):
    if name not in obj or obj[name] is None:
        return None
    s = obj[name]
    if not isinstance(s, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                          for x in s):
        problems.append(f"{where}: field {name!r} must be a list of finite numbers")
        return None
    if len(s) != n_docs:
        problems.append(f"{where}: field {name!r} has {len(s)} scores for {n_docs} docs")
        return None
    return [float(x) for x in s]


# ----- training formats ----------------------------------------------------------------------------
# A parser returns (query, prompt, pos, neg, pos_scores, neg_scores) or None (problems added); a doc
# in pos/neg is ("text", str) or ("id", str).

INLINE_ALIASES = {"query": ("query", "question"), "pos": ("pos_doc", "pos"), "neg": ("neg_doc", "neg")}


def _pick(obj, names, where, problems):
    """(name used, value, given) for one of `names`; a clash is a problem."""
    given = [n for n in names if n in obj]
    if len(given) > 1:
        problems.append(f"{where}: both {given[0]!r} and {given[1]!r} given; use one")
        return given[0], None, True
    if not given:
        return names[0], None, False
    return given[0], obj[given[0]], True


def _query(obj, names, where, problems):
    n0 = len(problems)
    name, value, given = _pick(obj, names, where, problems)
    if len(problems) > n0:
        return None
    if not given:
        problems.append(f"{where}: missing field {names[0]!r}" + (f" (or {names[1]!r})" if len(names) > 1 else ""))
        return None
    return check(text_problem, value, where, f"field {name!r}", problems)


def _inline_doc(doc, where, what, corpus, problems):
    if isinstance(doc, str) and corpus:
        return ("id", doc) if check(id_problem, doc, where, what, problems) is not None else None
    if isinstance(doc, str):
        return ("text", doc) if check(text_problem, doc, where, what, problems) is not None else None
    if isinstance(doc, dict):
        if "text" in doc:
            return ("text", doc["text"]) if check(text_problem, doc["text"], where, f"{what}.text", problems) \
                is not None else None
        if "id" in doc and corpus:
            return ("id", doc["id"]) if check(id_problem, doc["id"], where, f"{what}.id", problems) is not None \
                else None
        problems.append(f"{where}: {what} is an object without 'text'" +
                        (" (a doc given by id needs --corpus)" if "id" in doc else ""))
        return None
    problems.append(f"{where}: {what} must be a string or an object with 'text', got {json_type(doc)}")
    return None


def _inline_plain(obj, corpus):
    """parse_inline's result for a record with nothing to report and nothing optional (lists of plain
    strings, no scores, no prompt: the common shape, read without a call per doc); None otherwise."""
    if "question" in obj or ("pos" in obj) == ("pos_doc" in obj) or ("neg" in obj and "neg_doc" in obj) \
            or obj.get("pos_scores") is not None or obj.get("neg_scores") is not None or obj.get("prompt") is not None:
        return None
    query, pos = obj.get("query"), obj["pos_doc"] if "pos_doc" in obj else obj["pos"]
    neg = obj["neg_doc"] if "neg_doc" in obj else obj.get("neg", [])
    if type(pos) is not list or not pos or type(neg) is not list or not plain_text(query) \
            or not all(type(d) is str and d.isascii() and d[:1].isalnum() for d in pos + neg):  # plain_text, inlined
        return None
    kind = "id" if corpus else "text"
    return query, None, [(kind, d) for d in pos], [(kind, d) for d in neg], None, None


def parse_inline(obj, where, corpus, problems):
    """NeMo inline and FlagEmbedding records."""
    plain = _inline_plain(obj, corpus)
    if plain is not None:
        return plain
    n0 = len(problems)
    query = _query(obj, INLINE_ALIASES["query"], where, problems)
    docs = {}
    for key, required in (("pos", True), ("neg", False)):
        n1 = len(problems)
        name, value, given = _pick(obj, INLINE_ALIASES[key], where, problems)
        docs[key] = []
        if len(problems) > n1:
            continue
        if not given:
            if required:
                problems.append(f"{where}: missing field 'pos_doc' (or 'pos')")
            continue
        if value is None:
            problems.append(f"{where}: field {name!r} is null" +
                            ("; a record needs at least one positive" if required else "; use [] for none"))
            continue
        if isinstance(value, (str, dict)):
            value = [value]
        if not isinstance(value, list):
            problems.append(f"{where}: field {name!r} must be a list of docs, got {json_type(value)}")
            docs[key] = []
            continue
        if required and not value:
            problems.append(f"{where}: field {name!r} is empty; a record needs at least one positive")
        docs[key] = [_inline_doc(d, where, f"{name}[{i}]", corpus, problems) for i, d in enumerate(value)]
    pos_scores = _scores(obj, "pos_scores", len(docs["pos"]), where, problems)
    neg_scores = _scores(obj, "neg_scores", len(docs["neg"]), where, problems)
    prompt = obj.get("prompt")
    if prompt is not None:
        prompt = check(text_problem, prompt, where, "field 'prompt'", problems)
    if len(problems) > n0:
        return None
    return query, prompt, docs["pos"], docs["neg"], pos_scores, neg_scores


NEGATIVE_N = re.compile(r"negative_(\d+)$")


def parse_st(obj, where, corpus, problems):
    """sentence-transformers columns: (anchor|query, positive, negative | negative_1..n), one text each."""
    n0 = len(problems)
    query = _query(obj, ("anchor", "query"), where, problems)
    if "positive" not in obj:
        problems.append(f"{where}: missing field 'positive'")
    pos = check(text_problem, obj.get("positive"), where, "field 'positive'", problems) if "positive" in obj else None
    numbered = sorted((int(m.group(1)), k) for k in obj if (m := NEGATIVE_N.match(k)))
    if "negative" in obj and numbered:
        problems.append(f"{where}: both 'negative' and {numbered[0][1]!r} given; use one")
    names = ["negative"] if "negative" in obj else [k for _, k in numbered]
    if numbered and [i for i, _ in numbered] != list(range(1, len(numbered) + 1)):
        problems.append(f"{where}: negative columns must be negative_1..negative_{len(numbered)} without gaps")
    neg = [check(text_problem, obj[k], where, f"field {k!r}", problems) for k in names]
    if len(problems) > n0:
        return None
    return query, None, [("text", pos)], [("text", t) for t in neg], None, None


def _tevatron_passage(p, where, what, corpus, problems):
    if not isinstance(p, dict):
        problems.append(f"{where}: {what} must be an object with 'docid', 'title', 'text', got {json_type(p)}")
        return None
    if "text" not in p or (p["text"] is None and corpus):
        if corpus and "docid" in p:
            return ("id", p["docid"]) if check(id_problem, p["docid"], where, f"{what}.docid", problems) is not None \
                else None
        problems.append(f"{where}: {what} has no 'text'" + (" (a passage given by docid needs --corpus)"
                                                           if "docid" in p else ""))
        return None
    title = p.get("title")
    if title is not None and not isinstance(title, str):
        problems.append(f"{where}: {what}.title must be a string, got {json_type(title)}")
        return None
    text = p["text"]
    if isinstance(text, str) and title and title.strip():
        text = f"{title} {text}".strip()  # title and text joined by a space, as for BEIR documents
    return ("text", text) if check(text_problem, text, where, f"{what}.text", problems) is not None else None


def parse_tevatron(obj, where, corpus, problems):
    """Tevatron: query + positive_passages / negative_passages of {docid, title, text}."""
    n0 = len(problems)
    query = _query(obj, ("query",), where, problems)
    docs = {}
    for name, required in (("positive_passages", True), ("negative_passages", False)):
        value = obj.get(name)
        if value is None:
            if required:
                problems.append(f"{where}: " + (f"field {name!r} is null" if name in obj else f"missing field {name!r}"))
            docs[name] = []
            continue
        if not isinstance(value, list) or (required and not value):
            problems.append(f"{where}: field {name!r} must be a list of passages" +
                            (" with at least one" if required else "") + f", got {json_type(value)}"
                            + (" (empty)" if value == [] else ""))
            docs[name] = []
            continue
        docs[name] = [_tevatron_passage(p, where, f"{name}[{i}]", corpus, problems) for i, p in enumerate(value)]
    if len(problems) > n0:
        return None
    return query, None, docs["positive_passages"], docs["negative_passages"], None, None


# name, how it is told from the first record's fields, parser, the fields it reads
FORMATS = [
    ("Tevatron", lambda k: "positive_passages" in k or "negative_passages" in k, parse_tevatron,
     {"query", "positive_passages", "negative_passages"}),
    ("sentence-transformers columns", lambda k: "anchor" in k or "positive" in k, parse_st,
     {"anchor", "query", "positive", "negative"}),
    ("FlagEmbedding", lambda k: "pos" in k, parse_inline,
     {"query", "question", "pos", "neg", "pos_doc", "neg_doc", "pos_scores", "neg_scores", "prompt"}),
    ("NeMo inline", lambda k: True, parse_inline,
     {"query", "question", "pos", "neg", "pos_doc", "neg_doc", "pos_scores", "neg_scores", "prompt"}),
]


def detect_format(obj):
    """(name, parser, fields read) of the format whose fields `obj` (a file's first record) has."""
    keys = set(obj)
    return next((name, parser, fields) for name, told, parser, fields in FORMATS if told(keys))


def unread_fields(obj, fields):
    return [k for k in obj if k not in fields and not (k.startswith("negative_") and NEGATIVE_N.match(k))]


# ----- BEIR ----------------------------------------------------------------------------------------

def read_corpus(path, cache=None):
    """A BEIR corpus.jsonl (plain or .gz) as a textstore.Corpus. A document's text is its title and
    text joined by a space, as BEIR's dense baselines do; `_id` must be a unique non-empty string.
    cache: where its data cache is (datacache.entry_path: "auto", "off"/None, or a folder)."""
    from . import datacache
    from .textstore import Corpus

    built = []

    def build():
        built.append(_parse_corpus(path))
        return built[0].to_arrays(), {"digest": datacache.fingerprint(path)["content"]}  # (hashed once)
    arrays, info, state = datacache.cached(path, cache, {"what": "corpus"}, build, path)
    if state is None:
        return built[0]
    del built[:]  # the mapped pages replace the parsed copy, in the process that built them too
    corpus = Corpus.mapped(path, arrays)
    corpus.digest = info["digest"]
    return corpus


@gc_paused()
def _parse_corpus(path):
    from .textstore import Corpus

    corpus, problems = Corpus(path), []
    for lineno, obj in jsonl_objects(path, problems):
        title, text = obj.get("title"), obj.get("text")
        if title in (None, "") and plain_text(text) and plain_text(obj.get("_id")):  # nothing to report
            corpus.add(obj["_id"], text.strip(), lineno)
            continue
        where = f"{path}:{lineno}"
        n0 = len(problems)
        if "_id" not in obj:
            problems.append(f"{where}: missing field '_id'")
        else:
            check(id_problem, obj["_id"], where, "field '_id'", problems)
        if title is not None and not isinstance(title, str):
            problems.append(f"{where}: field 'title' must be a string, got {json_type(title)}")
        if "text" not in obj:
            problems.append(f"{where}: missing field 'text'")
        elif not isinstance(text, str):
            problems.append(f"{where}: field 'text' must be a string, got {json_type(text)}")
        elif len(problems) == n0:
            text = f"{title or ''} {text}".strip()
            check(text_problem, text, where, "the document's title and text", problems)
        if len(problems) == n0:
            corpus.add(obj["_id"], text, lineno)
    if not len(corpus) and not problems:
        problems.append(f"{path}: no documents (the file is empty)")
    raise_problems(path, problems)
    dups = corpus.finish()
    raise_problems(path, [f"{path}:{b}: duplicate _id {i!r} (first at line {a})" for a, b, i in dups])
    return corpus


def read_queries(path):
    """A BEIR queries.jsonl: {query id: text}, ids unique."""
    queries, problems, first = {}, [], {}
    for lineno, obj in jsonl_objects(path, problems):
        where = f"{path}:{lineno}"
        n0 = len(problems)
        for name, problem_fn in (("_id", id_problem), ("text", text_problem)):
            if name not in obj:
                problems.append(f"{where}: missing field {name!r}")
            else:
                check(problem_fn, obj[name], where, f"field {name!r}", problems)
        if len(problems) > n0:
            continue
        qid = obj["_id"]
        if qid in first:
            problems.append(f"{where}: duplicate _id {qid!r} (first at line {first[qid]})")
            continue
        first[qid], queries[qid] = lineno, obj["text"]
    if not queries and not problems:
        problems.append(f"{path}: no queries (the file is empty)")
    raise_problems(path, problems)
    return queries


def read_qrels(path, queries):
    """A BEIR qrels tsv (query-id, corpus-id, integer score; an optional header): {qid: {doc id: score}}."""
    qrels, problems = {}, []
    for lineno, line in text_lines(path, problems):
        parts = line.rstrip("\r\n").split("\t")
        if lineno == 1 and parts[0] == "query-id" or not line.strip():
            continue
        where = f"{path}:{lineno}"
        if len(parts) != 3 or not re.fullmatch(r"-?\d+", parts[2].strip()) or not parts[0] or not parts[1]:
            problems.append(f"{where}: expected 'query-id<TAB>corpus-id<TAB>integer score'")
        elif parts[0] not in queries:
            problems.append(f"{where}: query-id {parts[0]!r} is not in queries.jsonl")
        else:
            qrels.setdefault(parts[0], {})[parts[1]] = int(parts[2])
    if not qrels and not problems:
        problems.append(f"{path}: no judgments (the file is empty or only a header)")
    raise_problems(path, problems)
    return qrels
