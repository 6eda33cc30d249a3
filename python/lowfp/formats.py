"""Floating-point formats fp(e, m, b) and the named formats of docs/design.md §2.

>>> import lowfp
>>> f = lowfp.fp(4, 3, 4)
>>> f.max, f.min_normal, f.min_subnormal
(30.0, 0.0009765625, 0.0001220703125)
>>> lowfp.formats.float8_e4m3fn == lowfp.Format.parse("float8_e4m3fn")
True
"""

from __future__ import annotations

import ast
import math
import re
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from . import _C
from ._checks import check_choice, check_int, is_dtype_in, is_real

__all__ = ["Format", "fp", "named", "to_format", "S2FP8", "to_precision", "SPECIALS",
           "OVERFLOW_POLICIES"]

SPECIALS = ("none", "ieee", "fn", "fnuz", "p3109")
OVERFLOW_POLICIES = ("saturate", "inf", "nan")
# docs/design.md §3: the overflow policy a format uses unless a call overrides it.
DEFAULT_OVERFLOW = {"none": "saturate", "ieee": "inf", "fn": "saturate", "fnuz": "nan", "p3109": "inf"}

_TORCH_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}



@torch.compiler.assume_constant_result  # under torch.compile: computed while tracing
def _format_info(e: int, m: int, b: int, specials: str, subnormals: bool) -> dict:
    """The native library's facts about a format (bias, emin, emax, smallest_exp, max,
    fit_errors); a ValueError for parameters it cannot represent."""
    try:
        return _C.format_info(e, m, b, SPECIALS.index(specials), subnormals)
    except ValueError as err:
        raise ValueError(f"invalid format fp({e},{m},{b}, specials={specials!r}): {err}") from None


class Format:
    """A binary floating-point format with ``e`` exponent bits, ``m`` mantissa bits and an extra
    exponent bias ``b`` (bias = 2^(e-1) - 1 + b).

    ``specials`` picks the special-value convention: ``"none"`` (every code finite),
    ``"ieee"`` (top exponent code is inf/NaN), ``"fn"`` (only the all-ones code is NaN, as OCP
    E4M3), ``"fnuz"`` (the value set of ``"none"`` without negative zero) or ``"p3109"`` (IEEE
    P3109's extended domain: the all-ones code is ±inf, no negative zero). ``overflow`` is the
    default overflow policy (``"saturate"``, ``"inf"`` or ``"nan"``; None picks the convention's
    default: saturate for none/fn, inf for ieee and p3109, nan for fnuz).
    """

    __slots__ = ("_key", "_hash", "_info")

    def __init__(self, e: int, m: int, b: int = 0, *, specials: str = "none",
                 subnormals: bool = True, overflow: Optional[str] = None):
        e, m, b = check_int(e, "e"), check_int(m, "m"), check_int(b, "b")
        check_choice(specials, SPECIALS, "specials")
        if not isinstance(subnormals, bool):
            raise TypeError(f"subnormals must be a bool, got {subnormals!r}")
        if overflow is None:
            overflow = DEFAULT_OVERFLOW[specials]
        check_choice(overflow, OVERFLOW_POLICIES, "overflow")
        self._key = (e, m, b, specials, subnormals, overflow)
        # Hashed on first use and kept (each remembered quantize call hashes its format); not
        # here: some Dynamo versions (torch 2.11's) cannot trace hash() of a tuple, and formats
        # built inside compiled code run this.
        self._hash = None
        self._info = _format_info(e, m, b, specials, subnormals)

    # -- parameters -------------------------------------------------------------------------
    e = property(lambda self: self._key[0], doc="exponent bits")
    m = property(lambda self: self._key[1], doc="mantissa (fraction) bits")
    b = property(lambda self: self._key[2], doc="extra exponent bias")
    specials = property(lambda self: self._key[3], doc="special-value convention")
    subnormals = property(lambda self: self._key[4], doc="whether subnormals exist")
    overflow = property(lambda self: self._key[5], doc="default overflow policy")

    # -- derived ----------------------------------------------------------------------------
    @property
    def bias(self) -> int:
        """Exponent bias B = 2^(e-1) - 1 + b."""
        return self._info["bias"]

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return self._info["emin"]

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        return self._info["emax"]

    @property
    def max(self) -> float:
        """Largest finite value."""
        return self._info["max"]

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> Optional[float]:
        """Smallest positive subnormal (None when the format has no subnormals)."""
        return math.ldexp(1.0, self.emin - self.m) if self.subnormals else None

    @property
    def smallest(self) -> float:
        """Smallest positive value (a subnormal, or min_normal without subnormals)."""
        return math.ldexp(1.0, self._info["smallest_exp"])

    @property
    def eps(self) -> float:
        """Distance from 1 to the next larger value, 2^-m."""
        return math.ldexp(1.0, -self.m)

    @property
    def bits(self) -> int:
        """Storage bits: sign + e + m."""
        return 1 + self.e + self.m

    @property
    def range_binades(self) -> float:
        """Dynamic range log2(max / smallest) in binades."""
        return math.log2(self.max) - self._info["smallest_exp"]

    @property
    def name(self) -> Optional[str]:
        """The named format this equals, if any."""
        return _NAME_OF_KEY.get(self._key)

    def fit_error(self, dtype: torch.dtype) -> Optional[str]:
        """None when every value of the format is exact in ``dtype`` (docs/design.md §2), else
        which limit it exceeds."""
        if not is_dtype_in(dtype, _TORCH_DTYPE_NAMES):
            raise TypeError(f"dtype must be one of {tuple(_TORCH_DTYPE_NAMES)}, got {dtype!r}")
        return self._info["fit_errors"][_TORCH_DTYPE_NAMES[dtype]] or None

    def fits(self, dtype: torch.dtype) -> bool:
        return self.fit_error(dtype) is None

    def replace(self, *, overflow: Optional[str] = None, subnormals: Optional[bool] = None) -> "Format":
        """This format with another default overflow policy or subnormal setting."""
        e, m, b, specials, sub, ovf = self._key
        return Format(e, m, b, specials=specials,
                      subnormals=sub if subnormals is None else subnormals,
                      overflow=ovf if overflow is None else overflow)

    # -- value semantics --------------------------------------------------------------------
    @property
    def key(self) -> Tuple:
        """(e, m, b, specials, subnormals, overflow): what equality and hashing compare."""
        return self._key

    def __eq__(self, other) -> bool:
        return isinstance(other, Format) and other._key == self._key

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = self._hash = hash(self._key)
        return h

    def __str__(self) -> str:
        if self.name is not None:
            return self.name
        e, m, b, specials, subnormals, overflow = self._key
        extra = ""
        if specials != "none":
            extra += f",specials={specials!r}"
        if not subnormals:
            extra += ",subnormals=False"
        if overflow != DEFAULT_OVERFLOW[specials]:
            extra += f",overflow={overflow!r}"
        return f"fp({e},{m},{b}{extra})"

    __repr__ = __str__

    def __reduce__(self):
        return (Format.parse, (str(self),))

    @staticmethod
    def parse(text: str) -> "Format":
        """Parse a named format (``"float8_e4m3fn"``) or ``"fp(e,m[,b][,specials=...,...])"``."""
        if not isinstance(text, str):
            raise TypeError(f"format string expected, got {type(text).__name__}")
        s = text.strip()
        if s in _NAMED:
            return _NAMED[s]
        k_p = _P3109_NAME.fullmatch(s)
        if k_p:
            return p3109(int(k_p[1]), int(k_p[2]), "extended" if k_p[3] == "e" else "finite")
        call = parse_call(s, ("fp",))
        if call is None:
            raise ValueError(f"cannot parse format {text!r}: expected one of {sorted(_NAMED)} "
                             "or 'fp(e,m,b)' such as 'fp(4,3,4)'" + "".join(h(s) for h in _PARSE_HINTS))
        return fp(*call[0], **call[1])


def parse_call(text: str, names: Tuple[str, ...]) -> Optional[Tuple[list, dict]]:
    """The literal arguments of ``name(...)`` for a name in ``names``, or None when the text is
    not such a call. Non-literal arguments are a ValueError."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in names):
        return None
    try:
        return ([ast.literal_eval(a) for a in node.args],
                {k.arg: ast.literal_eval(k.value) for k in node.keywords})
    except ValueError:
        raise ValueError(f"cannot parse {text!r}: arguments must be literals") from None


def parse_named_or_call(text, named: dict, call_name: str, what: str, example: str):
    """(value, None) for a name of ``named`` (surrounding spaces ignored), or (None, (args,
    kwargs)) for the text of a call ``call_name(...)`` with literal arguments; a TypeError for a
    non-string and a ValueError naming ``what`` and showing ``example`` for anything else."""
    if not isinstance(text, str):
        raise TypeError(f"{what} string expected, got {type(text).__name__}")
    s = text.strip()
    if s in named:
        return named[s], None
    call = parse_call(s, (call_name,))
    if call is None:
        raise ValueError(f"cannot parse {what} {text!r}: expected one of {sorted(named)} or {example}")
    return None, call


def as_text(fmt):
    """A Format or S2FP8 as its string (which parses back to an equal one); anything else as it
    is. Under torch.compile a format built inside the traced code is no constant that
    assume_constant_result functions can take, but its string is."""
    return str(fmt) if isinstance(fmt, (Format, S2FP8)) else fmt


def fp(e: int, m: int, b: int = 0, *, specials: str = "none", subnormals: bool = True,
       overflow: Optional[str] = None) -> Format:
    """The format fp(e, m, b): ``specials="none"``, subnormals and saturation by default."""
    return Format(e, m, b, specials=specials, subnormals=subnormals, overflow=overflow)


def p3109(k: int, p: int, domain: str = "extended") -> Format:
    """IEEE P3109's signed format binaryKpP: K bits, precision P (1 <= P < K: e = K - P exponent
    bits, m = P - 1), exponent bias 2^(K-P-1) (b = 1), no negative zero (its code is NaN), and in
    the ``"extended"`` domain the all-ones code is ±inf (specials ``"p3109"``, overflow to inf by
    default), in the ``"finite"`` one every other code is finite (specials ``"fnuz"``, overflow
    saturating by default). Named ``p3109_k{K}p{P}se`` / ``sf`` as gfloat names them."""
    k, p = check_int(k, "k"), check_int(p, "p")
    check_choice(domain, ("extended", "finite"), "domain")
    if not (2 <= k <= 16 and 1 <= p < k):
        raise ValueError(f"p3109 takes 2 <= k <= 16 and 1 <= p < k, got k={k}, p={p}")
    return fp(k - p, p - 1, 1, specials="p3109" if domain == "extended" else "fnuz",
              overflow="inf" if domain == "extended" else "saturate")


_P3109_NAME = re.compile(r"p3109_k(\d+)p(\d+)s([ef])")


# What the layers above add to a parse error: each hint maps the text to a clause ("" for none).
# (lowfp.scaled names its formats and GEMM recipes, which this module does not import.)
_PARSE_HINTS: List[Callable[[str], str]] = []


def add_parse_hint(hint: Callable[[str], str]) -> None:
    _PARSE_HINTS.append(hint)


_NAMED: Dict[str, Format] = {
    "float16": fp(5, 10, 0, specials="ieee"),
    "bfloat16": fp(8, 7, 0, specials="ieee"),
    "float8_e5m2": fp(5, 2, 0, specials="ieee"),
    "float8_e4m3fn": fp(4, 3, 0, specials="fn"),
    "float8_e4m3": fp(4, 3, 0, specials="ieee"),
    "float8_e3m4": fp(3, 4, 0, specials="ieee"),
    "float8_e4m3fnuz": fp(4, 3, 1, specials="fnuz"),
    "float8_e5m2fnuz": fp(5, 2, 1, specials="fnuz"),
    "float8_e4m3b11fnuz": fp(4, 3, 4, specials="fnuz"),
    "float6_e3m2fn": fp(3, 2, 0),
    "float6_e2m3fn": fp(2, 3, 0),
    "float4_e2m1fn": fp(2, 1, 0),
}
# P3109's binary8pP formats (smaller K parse by name too: p3109_k6p3se, ...)
_NAMED.update({f"p3109_k8p{p}s{d[0]}": p3109(8, p, d) for p in range(1, 8) for d in ("extended", "finite")})
_NAME_OF_KEY = {f.key: name for name, f in _NAMED.items()}
globals().update(_NAMED)
__all__ += list(_NAMED)

# The precision-assignment paper's candidates (hi fp(6,9,0), lo fp(4,3,4) and fp(5,2,0)).
ASSIGNMENT_PAPER_FORMATS = {"fp(4,3,4)": fp(4, 3, 4), "fp(5,2,0)": fp(5, 2, 0), "fp(6,9,0)": fp(6, 9, 0)}


def named() -> Dict[str, Format]:
    """The named formats, by name."""
    return dict(_NAMED)


class S2FP8:
    """S2FP8 as a precision (docs/design.md §4): each tensor is squeezed and shifted by its own statistics
    α, β so that log2|Y| has mean 0 and maximum ``log_max``, Y is rounded to ``fmt``, and the
    result is mapped back. Accepted by :func:`lowfp.quantize` wherever a format is.

    ``bits`` is the storage per element (``fmt``'s); each tensor also keeps α and β.
    """

    __slots__ = ("fmt", "log_max")

    def __init__(self, fmt: Union["Format", str] = "float8_e5m2", log_max: float = 15.0):
        fmt = to_format(fmt, "fmt")
        if not is_real(log_max):
            raise TypeError(f"log_max must be a real number, got {type(log_max).__name__}")
        log_max = float(log_max)
        if not (0.0 < log_max < 1e300):
            raise ValueError(f"log_max must be finite and > 0, got {log_max}")
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "log_max", log_max)

    def __setattr__(self, name, value):
        raise AttributeError("S2FP8 is immutable")

    @property
    def bits(self) -> int:
        return self.fmt.bits

    @property
    def key(self) -> Tuple:
        return ("s2fp8", self.fmt.key, self.log_max)

    def __eq__(self, other) -> bool:
        return isinstance(other, S2FP8) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __str__(self) -> str:
        return f"S2FP8({str(self.fmt)!r}, log_max={self.log_max!r})"

    __repr__ = __str__

    def __reduce__(self):
        return (S2FP8, (self.fmt, self.log_max))

    @staticmethod
    def parse(text: str) -> "S2FP8":
        """``"s2fp8"`` (the defaults) or ``"S2FP8('float8_e5m2', log_max=15.0)"``."""
        s = text.strip()
        if s.lower() == "s2fp8":
            return S2FP8()
        call = parse_call(s, ("S2FP8", "s2fp8"))
        if call is None:
            raise ValueError(f"cannot parse {text!r} as S2FP8: expected \"S2FP8('float8_e5m2', "
                             "log_max=15.0)\" or 's2fp8'")
        return S2FP8(*call[0], **call[1])


Precision = Union[Format, S2FP8]


def to_precision(value, argname: str = "fmt") -> Precision:
    """A Format or an S2FP8 (or the string of either); anything else is a TypeError."""
    if isinstance(value, (Format, S2FP8)):
        return value
    if isinstance(value, str) and value.strip().lower().startswith("s2fp8"):
        try:
            return S2FP8.parse(value)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{argname}: {err}") from None
    if isinstance(value, str):
        return to_format(value, argname)
    raise TypeError(f"{argname} must be a lowfp.Format, a lowfp.S2FP8 or a format string such as "
                    f"'fp(4,3,4)', 'float8_e4m3fn' or 's2fp8', got {type(value).__name__}")


def to_format(value: Union[Format, str], argname: str = "fmt") -> Format:
    """Accept a Format or its string form; anything else is a TypeError naming ``argname``."""
    if isinstance(value, Format):
        return value
    if isinstance(value, str):
        try:
            return Format.parse(value)
        except ValueError as err:
            raise ValueError(f"{argname}: {err}") from None
        except TypeError as err:  # a literal of the wrong type: "fp(4.0,3)", "fp(True,3)"
            raise TypeError(f"{argname}: {err} in {value!r}") from None
    raise TypeError(f"{argname} must be a lowfp.Format or a format string such as 'fp(4,3,4)' "
                    f"or 'float8_e4m3fn', got {type(value).__name__}")
