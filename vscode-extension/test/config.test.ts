// config.ts: defaults, mldebug options from breakOn/breakOnNaN/watch/view, program vs module,
// attach passthrough, and the schema in package.json matching the TypeScript attributes.
import { describe, it } from 'node:test';
import * as assert from 'node:assert/strict';
import * as pkg from '../package.json';
import {
  ATTACH_ATTRIBUTES, ATTRIBUTE_LISTS_COMPLETE, LAUNCH_ATTRIBUTES, MlDebugConfig, NOTHING_TO_RUN, ResolveContext,
  breakOnOption, fillDefaults, mldebugOptions, toDebugpy,
} from '../src/config';

const ctx: ResolveContext = { workspaceFolder: '/ws' };

function launch(config: MlDebugConfig, context: ResolveContext = ctx) {
  const filled = fillDefaults({ type: 'mldebug', request: 'launch', name: 'n', ...config }, context);
  assert.ok(filled.ok, filled.ok ? '' : filled.message);
  const resolved = toDebugpy(filled.config, context);
  assert.ok(resolved.ok, resolved.ok ? '' : resolved.message);
  return resolved.config;
}

describe('fillDefaults', () => {
  it('launches the active Python file when there is no launch.json', () => {
    const r = fillDefaults({}, { activePythonFile: '/ws/train.py', workspaceFolder: '/ws' });
    assert.deepEqual(r, { ok: true, config: {
      type: 'mldebug', request: 'launch', name: 'mldebug: current file', program: '/ws/train.py', justMyCode: true, cwd: '/ws',
    } });
  });
  it('cancels with a message when there is nothing to run', () => {
    assert.deepEqual(fillDefaults({}, ctx), { ok: false, message: NOTHING_TO_RUN });
    assert.deepEqual(fillDefaults({ type: 'mldebug', request: 'launch', name: 'x' }, ctx), { ok: false, message: NOTHING_TO_RUN });
  });
  it('refuses program and module together, naming both', () => {
    const r = fillDefaults({ type: 'mldebug', request: 'launch', name: 'x', program: 'a.py', module: 'pkg' }, ctx);
    assert.ok(!r.ok && r.message.includes('"a.py"') && r.message.includes('"pkg"'));
  });
  it('takes the interpreter from python.defaultInterpreterPath unless python is given', () => {
    const r = fillDefaults({ type: 'mldebug', request: 'launch', name: 'x', program: 'a.py' }, { defaultPython: '/venv/bin/python' });
    assert.ok(r.ok && r.config.python === '/venv/bin/python');
    const own = fillDefaults({ type: 'mldebug', request: 'launch', name: 'x', program: 'a.py', python: '/my/python' }, { defaultPython: '/venv/bin/python' });
    assert.ok(own.ok && own.config.python === '/my/python');
  });
  it('refuses an unknown request', () => {
    const r = fillDefaults({ type: 'mldebug', request: 'run', name: 'x', program: 'a.py' }, ctx);
    assert.ok(!r.ok && r.message.includes('"run"'));
  });
});

describe('breakOnOption', () => {
  it('leaves mldebug its default when neither breakOn nor breakOnNaN is set', () => {
    assert.deepEqual(breakOnOption({}), { ok: true, config: undefined });
  });
  it('breakOnNaN true adds nan and inf', () => {
    assert.deepEqual(breakOnOption({ breakOnNaN: true, breakOn: ['exception'] }), { ok: true, config: 'nan,inf,exception' });
    assert.deepEqual(breakOnOption({ breakOnNaN: true }), { ok: true, config: 'nan,inf,assert,exception' });
  });
  it('breakOnNaN false removes them', () => {
    assert.deepEqual(breakOnOption({ breakOnNaN: false }), { ok: true, config: 'assert,exception' });
  });
  it('an empty breakOn is none', () => {
    assert.deepEqual(breakOnOption({ breakOn: [] }), { ok: true, config: 'none' });
  });
  it('names an unknown kind', () => {
    const r = breakOnOption({ breakOn: ['nans' as 'nan'] });
    assert.ok(!r.ok && r.message.includes('"nans"'));
  });
});

describe('mldebugOptions', () => {
  it('passes --watch and --view only when set', () => {
    assert.deepEqual(mldebugOptions({}), { ok: true, config: [] });
    assert.deepEqual(mldebugOptions({ watch: false, view: true }), { ok: true, config: ['--watch', 'off', '--view'] });
    assert.deepEqual(mldebugOptions({ watch: true, view: 5007 }), { ok: true, config: ['--watch', 'on', '--view=5007'] });
    assert.deepEqual(mldebugOptions({ view: false }), { ok: true, config: [] });
  });
});

describe('toDebugpy launch', () => {
  it('runs the program under python -m mldebug with debugpy attributes', () => {
    assert.deepEqual(launch({ program: '/ws/train.py', args: ['--lr', '0.1'], breakOnNaN: true, env: { A: '1' } }), {
      type: 'mldebug', request: 'launch', name: 'n', module: 'mldebug',
      args: ['--break-on', 'nan,inf,assert,exception', '/ws/train.py', '--lr', '0.1'],
      cwd: '/ws', env: { A: '1' }, justMyCode: true, console: 'internalConsole', python: ['python3'],
      redirectOutput: true, showReturnValue: true,
    });
  });
  it('runs a module with mldebug -m', () => {
    const c = launch({ module: 'pkg.train', args: ['-v'], watch: false });
    assert.equal(c.request, 'launch');
    assert.deepEqual(c.request === 'launch' && c.args, ['--watch', 'off', '-m', 'pkg.train', '-v']);
  });
  it('keeps justMyCode false, the console and the interpreter', () => {
    const c = launch({ program: 'a.py', justMyCode: false, console: 'integratedTerminal', python: '/v/bin/python' });
    assert.ok(c.request === 'launch');
    assert.equal(c.justMyCode, false);
    assert.equal(c.console, 'integratedTerminal');
    assert.deepEqual(c.python, ['/v/bin/python']);
  });
});

describe('toDebugpy attach', () => {
  it('passes connect through', () => {
    assert.deepEqual(toDebugpy({ type: 'mldebug', request: 'attach', name: 'a', connect: { host: '10.0.0.2', port: 5678 } }, ctx), {
      ok: true, config: { type: 'mldebug', request: 'attach', name: 'a', connect: { host: '10.0.0.2', port: 5678 }, justMyCode: true },
    });
  });
  it('accepts host and port as shorthand', () => {
    const r = toDebugpy({ type: 'mldebug', request: 'attach', name: 'a', port: 5679, justMyCode: false }, ctx);
    assert.ok(r.ok && r.config.request === 'attach');
    assert.deepEqual(r.config.connect, { host: '127.0.0.1', port: 5679 });
    assert.equal(r.config.justMyCode, false);
  });
  it('cancels without a port', () => {
    const r = toDebugpy({ type: 'mldebug', request: 'attach', name: 'a' }, ctx);
    assert.ok(!r.ok && r.message.includes('port'));
  });
});

describe('package.json schema', () => {
  const debuggerContribution = pkg.contributes.debuggers[0];
  const attrs = debuggerContribution.configurationAttributes;
  it('lists exactly the launch attributes of LaunchAttributes', () => {
    assert.ok(ATTRIBUTE_LISTS_COMPLETE);
    assert.deepEqual(Object.keys(attrs.launch.properties).sort(), [...LAUNCH_ATTRIBUTES].sort());
  });
  it('lists exactly the attach attributes of AttachAttributes', () => {
    assert.deepEqual(Object.keys(attrs.attach.properties).sort(), [...ATTACH_ATTRIBUTES].sort());
  });
  it('offers the same breakOn kinds as config.ts', () => {
    assert.deepEqual(attrs.launch.properties.breakOn.items.enum, ['nan', 'inf', 'inf-all', 'assert', 'exception']);
  });
  it('has initial configurations and snippets of type mldebug that resolve', () => {
    assert.ok(debuggerContribution.initialConfigurations.every((c) => c.type === 'mldebug'));
    assert.ok(debuggerContribution.configurationSnippets.every((s) => s.body.type === 'mldebug'));
    const initial = debuggerContribution.initialConfigurations[0] as MlDebugConfig;
    assert.ok(toDebugpy({ ...initial, program: '/ws/a.py' }, ctx).ok);
  });
  it('declares the debug type, the variables menu and the commands', () => {
    assert.equal(debuggerContribution.type, 'mldebug');
    assert.ok(pkg.contributes.menus['debug/variables/context'].some((m) => m.command === 'mldebug.inspectVariable'));
    assert.deepEqual(pkg.contributes.commands.map((c) => c.command).sort(),
      ['mldebug.inspectVariable', 'mldebug.openBrowserView', 'mldebug.showTensors']);
  });
});
