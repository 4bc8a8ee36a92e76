"""Tool calls and reasoning: what agents send and what models write back (parsers, grammars, templates)."""
