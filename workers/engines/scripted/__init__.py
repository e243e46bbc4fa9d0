"""The scripted engine: answers read from a script, for deterministic tests of the whole
path (parsers included) with a model's real output formats, and for users testing
their agents against headwater without a model.
"""

from workers.engines.scripted.config import ScriptedConfig
from workers.engines.scripted.engine import ScriptedCounters, ScriptedEngine
from workers.engines.scripted.script import Rule, Script, ScriptError, load_script, parse_script

__all__ = [
    "Rule",
    "Script",
    "ScriptError",
    "ScriptedConfig",
    "ScriptedCounters",
    "ScriptedEngine",
    "load_script",
    "parse_script",
]
