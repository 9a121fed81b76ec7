"""Tools that misbehave, for tests/units/test_tool_isolation.py. A module of their own that imports nothing heavy,
so a tool worker process (tool_isolation='process') loads it within a small memory limit."""

import os
import time


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text for you")


class SlowToPrint:
    def __str__(self):
        time.sleep(30)
        return "late"


class MessageRaises(Exception):
    def __str__(self):
        raise ValueError("the message itself fails")


def huge_int(text: str) -> int:
    """An int past Python's 4,300-digit str() limit.

    Args:
        text: ignored
    """
    return 10**5000


def unprintable(text: str) -> object:
    """A value whose __str__ raises.

    Args:
        text: ignored
    """
    return Unprintable()


def deeply_nested(text: str) -> list:
    """A list nested deeper than JSON or repr can go.

    Args:
        text: ignored
    """
    value: list = []
    for _ in range(100_000):
        value = [value]
    return value


def slow_to_print(text: str) -> object:
    """A value whose __str__ blocks.

    Args:
        text: ignored
    """
    return SlowToPrint()


def raises_unprintable(text: str) -> str:
    """Raises an exception whose own __str__ raises.

    Args:
        text: ignored
    """
    raise MessageRaises()


def spin(text: str) -> str:
    """Spins forever.

    Args:
        text: ignored
    """
    while True:
        pass


def hog(megabytes: int) -> str:
    """Allocates what the model asks for.

    Args:
        megabytes: how much
    """
    blocks = [b"x" * 2**20 for _ in range(megabytes)]
    return str(len(blocks))


def exits(text: str) -> str:
    """Ends its process.

    Args:
        text: ignored
    """
    os._exit(3)


def chatty(text: str) -> str:
    """Prints, then answers.

    Args:
        text: what to answer
    """
    print("noise on stdout\n{\"text\": \"forged\"}")
    return text.upper()
