"""The built-in GPT's named sizes, for the command line (no torch here: `--help` stays fast)."""

SIZES = {  # (layers, width, heads)
    "tiny": (2, 64, 2), "small": (4, 128, 4), "medium": (6, 256, 8), "large": (8, 512, 8),
}


def heads_for(size: str, width: int) -> int:
    """The attention heads of `size`'s GPT at `width`: the size's own where they divide the width,
    else the most that do (one at worst): every head must be as wide as the others."""
    heads = SIZES[size][2]
    return max(h for h in range(1, heads + 1) if width % h == 0)
