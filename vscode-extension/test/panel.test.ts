// panel.ts's page: the template's placeholders, BokehJS's script tags, and the CSP that
// media/panel.html declares (scripts by nonce only, no eval: BokehJS draws without CustomJS).
import { describe, it } from 'node:test';
import * as assert from 'node:assert/strict';
import { readFileSync } from 'fs';
import { join } from 'path';
import { fillTemplate, scriptTags } from '../src/panel';

const TEMPLATE = readFileSync(join(__dirname, '..', '..', 'media', 'panel.html'), 'utf8');
const VALUES = {
  cspSource: 'https://file+.vscode-resource.vscode-cdn.net', nonce: 'abc123', scriptUri: 'https://x/out/webview.js',
  styleUri: 'https://x/media/panel.css', bokehScripts: '',
};

describe('the panel page', () => {
  it('fills every placeholder', () => {
    const page = fillTemplate(TEMPLATE, { ...VALUES, bokehScripts: scriptTags(['https://x/py/bokeh.min.js'], 'abc123') });
    assert.doesNotMatch(page, /\{\{\w+\}\}/);
    // BokehJS comes before the page's own script, which draws with it
    assert.ok(page.indexOf('bokeh.min.js') < page.indexOf('webview.js'));
    assert.match(page, /<script nonce="abc123" src="https:\/\/x\/py\/bokeh\.min\.js"><\/script>/);
  });
  it('has no BokehJS before a graph came', () => {
    assert.doesNotMatch(fillTemplate(TEMPLATE, VALUES), /bokeh/);
  });
  it('allows scripts by nonce only, and no eval', () => {
    const csp = /Content-Security-Policy"\s+content="([^"]+)"/.exec(TEMPLATE)?.[1] ?? '';
    assert.match(csp, /script-src 'nonce-\{\{nonce\}\}';/);
    assert.doesNotMatch(csp, /unsafe-eval/);
    assert.match(csp, /default-src 'none'/);
  });
  it('escapes what it puts in attributes', () => {
    assert.equal(scriptTags(['a"b&c'], 'n"'), '<script nonce="n&quot;" src="a&quot;b&amp;c"></script>');
    assert.equal(scriptTags([], 'n'), '');
  });
});
