"""Seeded filler text whose length in sim tokens is exact.

Every word is three lowercase letters followed by one space: four characters, so one token for
a ~4-characters-per-token tokenizer and also one token for a word-level one.  A text of ``n``
words is therefore ``n`` tokens long, and two texts concatenated keep both lengths, which is
what lets the workloads control prompt, prefix and question lengths exactly.
"""

from __future__ import annotations

import random

__all__ = ["CHARS_PER_TOKEN", "WORDS", "estimate_tokens", "filler"]

CHARS_PER_TOKEN = 4

# Three-letter words (a fixed list, so a seed always gives the same text).
_WORD_TEXT = """
    act add age ago aid aim air all and ant any ape arc arm art ash ask bad bag ban bar bat bay
    bed bee bet bid big bin bit bow box boy bud bug bun bus but buy cab can cap car cat cow cry
    cub cup cut dam day den dew did die dig dim dip dog dot dry due dug dye ear eat egg elk elm
    end era eve eye fan far fat fax fed fee few fig fin fir fit fix fly fog for fox fry fun fur
    gap gas gem get gin got gum gun gut guy gym had ham has hat hay hen her hid him hip his hit
    hog hop hot how hub hue hug hum hut ice icy ill ink inn ion ivy jam jar jaw jet job jog joy
    jug key kid kin kit lab lad lap law lay led leg let lid lie lip lit log lot low mad man map
    mat may men met mix mob mop mud mug nap net new nod not now nut oak oar oat odd off oil old
    one opt orb ore our out owl own pad pal pan paw pay pea pen pet pie pig pin pit pod pop pot
    pro pub pun pup put rag ram ran rat raw ray red rib rid rig rim rip rod rot row rub rug run
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


def filler(rng: random.Random, tokens: int) -> str:
    """``tokens`` seeded words, each followed by a space (so ``4 * tokens`` characters)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return "".join(word + " " for word in rng.choices(WORDS, k=tokens))


def estimate_tokens(text: str) -> int:
    """Length of arbitrary text in sim tokens, approximately (characters / 4, rounded up)."""
    return -(-len(text) // CHARS_PER_TOKEN)
