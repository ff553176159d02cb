// pyrepr.ts: reading a str back from the repr debugpy's evaluate returns.
import { describe, it } from 'node:test';
import * as assert from 'node:assert/strict';
import { pythonStrLiteral, pythonStrValue } from '../src/pyrepr';

describe('pythonStrValue', () => {
  it('unquotes a single-quoted repr of JSON', () => {
    assert.equal(pythonStrValue(`'{"stop": null}'`), '{"stop": null}');
  });
  it('undoes the escapes repr adds to JSON text', () => {
    // repr(json.dumps({"q": "it's \"x\"\n\u00e9"})) as debugpy 1.8.22 returned it
    const repr = String.raw`'{"q": "it\'s \\"x\\"\\n\\u00e9"}'`;
    assert.deepEqual(JSON.parse(pythonStrValue(repr)), { q: 'it\'s "x"\n\u00e9' });
  });
  it('reads double-quoted reprs and \\x, \\u escapes', () => {
    assert.equal(pythonStrValue(String.raw`"it's \x41\u00e9\t"`), "it's A\u00e9\t");
  });
  it('leaves text that is not a repr alone', () => {
    assert.equal(pythonStrValue('{"a": 1}'), '{"a": 1}');
    assert.equal(pythonStrValue('http://127.0.0.1:5006/x'), 'http://127.0.0.1:5006/x');
  });
  it('round-trips with pythonStrLiteral for plain names', () => {
    assert.equal(pythonStrValue(pythonStrLiteral('model.fc.weight')), 'model.fc.weight');
  });
});
