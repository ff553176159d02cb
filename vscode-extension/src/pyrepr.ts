// Reads the value of a Python `str` back from its repr, as debugpy returns it for an
// `evaluate` of an expression whose value is a str (`'{"stop": null}'`, quotes and escapes
// included). Text that is not a quoted repr is returned unchanged.

const SIMPLE_ESCAPES: Record<string, string> = {
  '\\': '\\', "'": "'", '"': '"', n: '\n', r: '\r', t: '\t', a: '\x07', b: '\b', f: '\f', v: '\v', '0': '\0',
};
const HEX_LENGTH: Record<string, number> = { x: 2, u: 4, U: 8 };

export function pythonStrValue(text: string): string {
  const s = text.trim();
  const quote = s[0];
  if (s.length < 2 || (quote !== "'" && quote !== '"') || s[s.length - 1] !== quote) {
    return text;
  }
  let out = '';
  for (let i = 1; i < s.length - 1; i++) {
    const ch = s[i];
    if (ch !== '\\') {
      out += ch;
      continue;
    }
    const next = s[++i];
    const hex = HEX_LENGTH[next];
    if (hex !== undefined) {
      out += String.fromCodePoint(parseInt(s.slice(i + 1, i + 1 + hex), 16));
      i += hex;
    } else if (next in SIMPLE_ESCAPES) {
      out += SIMPLE_ESCAPES[next];
    } else {
      out += '\\' + next;          // Python keeps unknown escapes as they are
    }
  }
  return out;
}

/** A JS string as a Python string literal (JSON string escapes are valid Python escapes). */
export function pythonStrLiteral(value: string): string {
  return JSON.stringify(value);
}
