"""The built-in GPT's named sizes, for the command line (no torch here: `--help` stays fast)."""

SIZES = {  # (layers, width, heads)
    "tiny": (2, 64, 2), "small": (4, 128, 4), "medium": (6, 256, 8), "large": (8, 512, 8),
}
