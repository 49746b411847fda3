"""A ``--chat-template`` that cannot be used falls back to the model's own template with a
warning instead of stopping the server (llama-server keeps serving too); a missing
``--chat-template-file`` still stops the start."""

from __future__ import annotations

import logging

import pytest

from flashdraft.server.chat_templates import resolve_template


@pytest.mark.parametrize("value,words", [
    ("not-a-template", "neither a built-in"),
    ("{% for m in messages %}{{ m['content'] }}", "does not parse"),  # no endfor
])
@pytest.mark.parametrize("jinja,own", [(True, ("jinja", None)), (False, ("builtin", None))])
def test_an_unusable_template_falls_back_to_the_models_own_with_a_warning(caplog, value, words, jinja, own):
    caplog.set_level(logging.WARNING, logger="flashdraft.server")
    assert resolve_template(value, None, jinja=jinja) == own
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and words in warned[0] and "model's own template" in warned[0], warned


def test_a_file_that_does_not_parse_falls_back_too(caplog, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] ")
    caplog.set_level(logging.WARNING, logger="flashdraft.server")
    assert resolve_template(None, str(path), jinja=True) == ("jinja", None)
    assert any("--chat-template-file" in r.getMessage() for r in caplog.records)


def test_usable_templates_are_kept_and_a_missing_file_stops_the_start(tmp_path):
    good = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert resolve_template(good, None, jinja=True) == ("jinja", good)
    assert resolve_template("chatml", None, jinja=True) == ("builtin", "chatml")
    with pytest.raises(ValueError, match="chat-template-file"):
        resolve_template(None, str(tmp_path / "missing.jinja"), jinja=True)
