"""Lark grammars (the syntax vLLM's `grammar` also takes) rewritten as xgrammar's EBNF: rules and terminals,
alternatives over several lines, [optional], ~ repeats, "a".."z" ranges, -> aliases and priorities dropped,
/regex/ terminals translated piece by piece, and `%import common.X` for the usual terminals. Templates and
%ignore have no EBNF form here and are refused."""
import re

COMMON = {
    "DIGIT": '[0-9]', "HEXDIGIT": '[0-9a-fA-F]', "INT": '[0-9]+', "SIGNED_INT": '[+-]? INT',
    "DECIMAL": 'INT "." INT? | "." INT', "_EXP": '[eE] SIGNED_INT', "FLOAT": 'INT _EXP | DECIMAL _EXP?',
    "SIGNED_FLOAT": '[+-]? FLOAT', "NUMBER": 'FLOAT | INT', "SIGNED_NUMBER": '[+-]? NUMBER',
    "LCASE_LETTER": '[a-z]', "UCASE_LETTER": '[A-Z]', "LETTER": '[a-zA-Z]', "WORD": '[a-zA-Z]+',
    "CNAME": '[a-zA-Z_] [a-zA-Z0-9_]*', "WS_INLINE": '[ \\t]+', "WS": '[ \\t\\f\\r\\n]+',
    "CR": '"\\r"', "LF": '"\\n"', "NEWLINE": '("\\r"? "\\n")+',
    "ESCAPED_STRING": '"\\"" ([^"\\\\\\n] | "\\\\" [^\\n])* "\\""',
}
COMMON_NEEDS = {"SIGNED_INT": ["INT"], "DECIMAL": ["INT"], "_EXP": ["SIGNED_INT", "INT"],
                "FLOAT": ["INT", "_EXP", "DECIMAL", "SIGNED_INT"], "SIGNED_FLOAT": ["FLOAT", "INT", "_EXP", "DECIMAL",
                                                                                   "SIGNED_INT"],
                "NUMBER": ["FLOAT", "INT", "_EXP", "DECIMAL", "SIGNED_INT"],
                "SIGNED_NUMBER": ["NUMBER", "FLOAT", "INT", "_EXP", "DECIMAL", "SIGNED_INT"]}
RULE = re.compile(r"^([?!]?)([A-Za-z_][A-Za-z0-9_]*)(\.-?\d+)?\s*:(?!:)(.*)$")
RANGE = re.compile(r'"((?:[^"\\]|\\.))"\s*\.\.\s*"((?:[^"\\]|\\.))"')
TOKEN = re.compile(RANGE.pattern + r'|"(?:[^"\\]|\\.)*"i?|/(?:[^/\\]|\\.)+/[imsx]*|->\s*\w+|~\s*\d+(?:\s*\.\.\s*\d+)?|'
                   r'[A-Za-z_][A-Za-z0-9_]*|[()\[\]|?*+]|\S')


def is_lark(grammar: str) -> bool:
    """EBNF defines rules with ::=, Lark with a single colon."""
    lines = [_strip_comment(line).strip() for line in grammar.splitlines()]
    return not any("::=" in line for line in lines) and any(RULE.match(line) for line in lines)


def lark_to_ebnf(grammar: str) -> str:
    rules, imports = _rules(grammar)
    if "start" not in rules:
        raise ValueError("a Lark grammar needs a start rule")
    lines = [f"root ::= {_expansion(rules.pop('start'))}"]
    lines += [f"{name} ::= {_expansion(body)}" for name, body in rules.items()]
    lines += [f"{name} ::= {COMMON[name]}" for name in _with_needs(imports) if name not in rules]
    return "\n".join(lines)


def _strip_comment(line: str) -> str:
    return re.sub(r'^((?:[^"/#]|"(?:[^"\\]|\\.)*"|/(?:[^/\\]|\\.)+/)*?)\s*(#|//).*$', r"\1", line)


def _rules(grammar: str) -> tuple[dict[str, str], list[str]]:
    rules, imports, name = {}, [], None
    for raw in grammar.splitlines():
        line = _strip_comment(raw).strip()
        if not line:
            continue
        if line.startswith("%"):
            imports += _directive(line)
        elif (match := RULE.match(line)) is not None:
            name = match.group(2)
            rules[name] = match.group(4).strip()
        elif line.startswith("|") and name is not None:
            rules[name] += " " + line
        else:
            raise ValueError(f"Lark grammar: cannot read {raw.strip()!r}")
    return rules, imports


def _directive(line: str) -> list[str]:
    match = re.match(r"%import\s+common\.(\w+)$", line) or re.match(r"%import\s+common\s+\(([\w\s,]+)\)$", line)
    if match is None:
        raise ValueError(f"Lark grammar: {line!r} is not supported (only %import common.NAME)")
    names = [n.strip() for n in match.group(1).split(",")]
    unknown = [n for n in names if n not in COMMON]
    if unknown:
        raise ValueError(f"Lark grammar: common.{unknown[0]} is not one of {sorted(COMMON)}")
    return names


def _with_needs(imports: list[str]) -> list[str]:
    names = []
    for name in imports:
        names += [n for n in [name] + COMMON_NEEDS.get(name, []) if n not in names]
    return names


def _expansion(body: str) -> str:
    return " ".join(t for t in (_token(m.group(0)) for m in TOKEN.finditer(body)) if t)


def _token(token: str) -> str:
    if token.startswith("->"):
        return ""  # an alias names the tree node; the language is the same
    if token == "[" or token == "]":
        return "(" if token == "[" else ")?"
    if token.startswith("~"):
        return "{" + token[1:].replace("..", ",").replace(" ", "") + "}"
    if (match := RANGE.fullmatch(token)) is not None:
        return f"[{_class_char(match.group(1))}-{_class_char(match.group(2))}]"
    if token.startswith('"'):
        return _literal(token)
    if token.startswith("/"):
        return regex_to_ebnf(token)
    if len(token) == 1 and token not in "()|?*+" and not token.isalnum() and token != "_":
        raise ValueError(f"Lark grammar: unexpected {token!r} (templates and other extensions are not supported)")
    return token


def _literal(token: str) -> str:
    if token.endswith("i"):
        return "(" + " ".join(_either_case(c) for c in _unquote(token[:-1])) + ")"
    return token


def _class_char(char: str) -> str:
    char = char.encode().decode("unicode_escape")
    return "\\" + char if char in "]\\^-" else char


def _unquote(token: str) -> str:
    return token[1:-1].encode().decode("unicode_escape")


def _either_case(char: str) -> str:
    if char.lower() == char.upper():
        return '"' + char.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"[{char.lower()}{char.upper()}]"


def regex_to_ebnf(token: str) -> str:
    """A /regex/ piece by piece: classes and quantifiers as they are, escapes as classes, other characters
    as quoted literals, anchors dropped."""
    pattern, flags = token[1:token.rindex("/")], token[token.rindex("/") + 1:]
    if flags:
        raise ValueError(f"Lark grammar: regex flags {flags!r} are not supported in {token}")
    out, i = [], 0
    while i < len(pattern):
        piece, i = _regex_piece(pattern, i)
        out.append(piece)
    return "(" + " ".join(p for p in out if p) + ")"


ESCAPES = {"d": "[0-9]", "w": "[a-zA-Z0-9_]", "s": "[ \\t\\n\\r\\f]", "D": "[^0-9]", "W": "[^a-zA-Z0-9_]",
           "S": "[^ \\t\\n\\r\\f]", "n": '"\\n"', "t": '"\\t"', "r": '"\\r"'}


def _regex_piece(pattern: str, i: int) -> tuple[str, int]:
    char = pattern[i]
    if char == "[":
        end = _class_end(pattern, i)
        return pattern[i:end + 1], end + 1
    if char == "\\":
        nxt = pattern[i + 1]
        return ESCAPES.get(nxt, _quote(nxt)), i + 2
    if char == "(":
        return "(", i + 3 if pattern.startswith("(?:", i) else i + 1
    if char == "{":
        end = pattern.index("}", i)
        return pattern[i:end + 1], end + 1
    if char in ")|?*+":
        return char, i + 1
    if char in "^$":
        return "", i + 1
    return ('[^\\n]' if char == "." else _quote(char)), i + 1


def _class_end(pattern: str, start: int) -> int:
    i = start + 1 + (pattern[start + 1] == "^")
    i += pattern[i] == "]"
    while pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i


def _quote(char: str) -> str:
    return '"' + char.replace("\\", "\\\\").replace('"', '\\"') + '"'
