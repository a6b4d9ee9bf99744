"""A --reasoning-parser-plugin for the tests: registers "test_markers", thinking between two text markers
(not tokens, so it works with any tokenizer; the engine then refuses what needs one end-of-thinking token)."""

from ferrox.reasoning.families import Family
from ferrox.reasoning.plugin import register_reasoning_parser

register_reasoning_parser("test_markers", Family(("THINK:",), ("ANSWER:",), untagged="content",
                                                 tags_are_tokens=False))
