"""docs/PIPELINE.md is generated from the config model and committed up to date."""

from __future__ import annotations

from refold.config import Pipeline
from refold.dev.docgen import TARGET, generate, main


def test_committed_reference_equals_the_generated_one() -> None:
    assert TARGET.read_text() == generate(), "docs/PIPELINE.md is stale: run python -m refold.dev.docgen"
    assert main(["--check"]) == 0


def test_every_top_level_setting_is_documented() -> None:
    text = generate()
    for name, field in Pipeline.model_fields.items():
        assert f"| `{field.alias or name}` |" in text
    assert "`jsonl` \\| `avro` \\| `debezium-json`" in text
    assert "| `schema` | string (optional) |" in text  # the YAML key, not the attribute name
