// configProvider.ts and adapter.ts with the vscode API stubbed: what the editor's state
// changes, and that a configuration that cannot run is cancelled with a message.
import { beforeEach, describe, it } from 'node:test';
import * as assert from 'node:assert/strict';
import type * as vscode from 'vscode';
import { pythonEditor, recorded, resetStub, window, workspace } from './vscode-stub';
import { MlDebugConfigurationProvider } from '../src/configProvider';
import { DebugpyAdapterFactory, interpreterOf } from '../src/adapter';

const provider = new MlDebugConfigurationProvider();
const asConfig = (c: object): vscode.DebugConfiguration => c as vscode.DebugConfiguration;

async function resolveBoth(config: object): Promise<vscode.DebugConfiguration | undefined> {
  const first = await provider.resolveDebugConfiguration(undefined, asConfig(config));
  return first && provider.resolveDebugConfigurationWithSubstitutedVariables(undefined, first);
}

describe('resolveDebugConfiguration', () => {
  beforeEach(resetStub);

  it('F5 without launch.json launches the active Python file', async () => {
    window.activeTextEditor = pythonEditor('/ws/train.py');
    workspace.workspaceFolders = [{ uri: { fsPath: '/ws' } }];
    const c = await resolveBoth({});
    assert.equal(c?.module, 'mldebug');
    assert.deepEqual(c?.args, ['/ws/train.py']);
    assert.equal(c?.cwd, '/ws');
    assert.deepEqual(recorded.errors, []);
  });

  it('cancels with an error message when there is no program', async () => {
    const c = await provider.resolveDebugConfiguration(undefined, asConfig({ type: 'mldebug', request: 'launch', name: 'x' }));
    assert.equal(c, undefined);
    assert.equal(recorded.errors.length, 1);
    assert.match(recorded.errors[0], /"program".*"module"/);
  });

  it('does not launch a non-Python active editor', async () => {
    window.activeTextEditor = { document: { languageId: 'markdown', uri: { scheme: 'file', fsPath: '/ws/README.md' } } };
    assert.equal(await provider.resolveDebugConfiguration(undefined, asConfig({})), undefined);
    assert.equal(recorded.errors.length, 1);
  });

  it('uses python.defaultInterpreterPath for the program and the adapter', async () => {
    recorded.settings['python.defaultInterpreterPath'] = '/venv/bin/python';
    const c = await resolveBoth({ type: 'mldebug', request: 'launch', name: 'x', program: 'a.py', breakOnNaN: true });
    assert.deepEqual(c?.python, ['/venv/bin/python']);
    assert.deepEqual(c?.args, ['--break-on', 'nan,inf,assert,exception', 'a.py']);
    const session = { configuration: c, workspaceFolder: undefined } as unknown as vscode.DebugSession;
    const exe = new DebugpyAdapterFactory().createDebugAdapterDescriptor(session) as unknown as { command: string; args: string[] };
    assert.equal(exe.command, '/venv/bin/python');
    assert.deepEqual(exe.args, ['-m', 'debugpy.adapter']);
  });

  it('cancels an unknown breakOn kind in the second pass, naming it', async () => {
    const c = await resolveBoth({ type: 'mldebug', request: 'launch', name: 'x', program: 'a.py', breakOn: ['nan', 'NaNs'] });
    assert.equal(c, undefined);
    assert.match(recorded.errors[0], /"NaNs"/);
  });

  it('passes attach host and port through', async () => {
    const c = await resolveBoth({ type: 'mldebug', request: 'attach', name: 'a', host: 'localhost', port: 5678 });
    assert.deepEqual(c?.connect, { host: 'localhost', port: 5678 });
  });
});

describe('interpreterOf', () => {
  it('reads debugpy-style lists, plain strings, then the fallback', () => {
    assert.equal(interpreterOf(asConfig({ python: ['/a/python', '-X'] })), '/a/python');
    assert.equal(interpreterOf(asConfig({ python: '/b/python' })), '/b/python');
    assert.equal(interpreterOf(asConfig({}), '/c/python'), '/c/python');
    assert.equal(interpreterOf(asConfig({})), 'python3');
  });
});
