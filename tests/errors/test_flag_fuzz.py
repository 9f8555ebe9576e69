"""A fuzz of the command lines (issue 41): every flag of both scripts and of the python -m tools, given a
handful of invalid values, and every pair of the scripts' switches and valued flags together, parsed in
this process. What may come out: a parse (the value was valid after all) or one sentence and a non-zero
exit (SystemExit); any other exception is a traceback a user would see. The flags are read from the
parsers, so a new flag joins the fuzz without an edit here."""

import itertools
import os
import re

import pytest

from retrieval_kit import cli, evaluate, mine, plan, score

BAD = ["", "-1", "0", "nan", "inf", "1e309", "abc", "1.5", "--", "a,b,,c", "-0", "999999999999999999999"]


def flags_of(parser):
    return [a for a in parser._actions if a.option_strings and a.option_strings[-1].startswith("--")
            and a.option_strings[-1] != "--help"]


def outcome(call, argv):
    """None (parsed, or refused with SystemExit and a non-zero code), else what went wrong."""
    try:
        call(argv)
    except SystemExit as e:
        if e.code in (0, None):
            return f"exit 0 on {argv}"
    except Exception as e:  # noqa: BLE001 - the finding
        return f"{type(e).__name__}: {e} on {argv}"
    return None


@pytest.mark.parametrize("script", ["biencoder", "reranker"])
def test_every_flag_of_the_scripts_takes_bad_values_without_a_traceback(script, capsys):
    make = cli.biencoder_parser if script == "biencoder" else cli.reranker_parser
    found = []
    for action in flags_of(make()):
        name = action.option_strings[-1]
        values = [[]] if action.nargs == 0 else [[v] for v in BAD]
        for v in values:
            found.append(outcome(lambda argv: cli.parse(make(), argv), [name, *v]))
    capsys.readouterr()
    assert not [f for f in found if f], [f for f in found if f][:10]
    assert len(found) > 600  # every flag, each bad value


@pytest.mark.parametrize("script", ["biencoder", "reranker"])
def test_every_pair_of_the_scripts_flags_parses_or_is_refused_in_one_sentence(script, capsys):
    """Orphan and conflicting combinations: each switch and each valued flag (at a valid non-default value
    where one is at hand) together with every other."""
    make = cli.biencoder_parser if script == "biencoder" else cli.reranker_parser
    parser = make()
    picks = []
    for action in flags_of(parser):
        name = action.option_strings[-1]
        if action.nargs == 0:
            picks.append([name])
        elif action.choices:
            picks.append([name, str(list(action.choices)[-1])])
        elif action.type in (int, float) or getattr(action.type, "__name__", "") in ("parse",):
            picks.append([name, "2"])
    found = [outcome(lambda argv: cli.parse(make(), argv), a + b) for a, b in itertools.combinations(picks, 2)]
    capsys.readouterr()
    assert not [f for f in found if f], [f for f in found if f][:10]
    assert len(found) > 500


TOOLS = {"evaluate": evaluate, "mine": mine, "score": score, "plan": plan}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_flag_of_the_tools_takes_bad_values_without_a_traceback(tool, capsys):
    """Each tool's main(), with one flag at a bad value and a flag no parser has (so a value that turns out
    valid still ends in argparse's refusal, before any work starts): one sentence, exit 2."""
    module = TOOLS[tool]
    with pytest.raises(SystemExit):
        module.main(["--help"])
    names = sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", capsys.readouterr().out)) - {"--help"})
    assert len(names) > 3
    found = [outcome(module.main, [name, v, "--no-such-flag-anywhere"]) for name in names for v in BAD]
    capsys.readouterr()
    assert not [f for f in found if f], [f for f in found if f][:10]
    assert os.environ.get("RANK") is None  # (nothing here started a process group)
