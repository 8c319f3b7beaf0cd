"""The kernels' source texts, one module per kernel: `<kernel>.py` in the portable dialect
(kernels/dialect.py, rendered for CUDA and Metal alike), `<kernel>_cuda.py` in CUDA's own
(tensor cores, PTX). kernels/<kernel>.py builds and launches each."""


def replace_exactly(text: str, replacements: list[tuple[str, str, int]], loop: str, module: str) -> str:
    """`text` with each (old, new, times) applied, old found exactly `times` times; else a ValueError naming
    the loop and the module that must follow it (a quantized variant made from a 16-bit kernel's text)."""
    for old, new, times in replacements:
        found = text.count(old)
        if found != times:
            raise ValueError(f"the {loop} has {found} occurrences of {old.strip()[:40]!r}, not {times}: "
                             f"{module} must follow it")
        text = text.replace(old, new)
    return text
