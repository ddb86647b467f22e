"""Small arithmetic shared by the core: :func:`cdiv`."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division, e.g. the blocks of ``b`` tokens that hold ``a`` tokens."""
    return -(-a // b)
