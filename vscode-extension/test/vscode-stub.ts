// The part of the `vscode` API the tested modules use, as plain objects the tests can set
// and inspect (esbuild.mjs --tests aliases `vscode` to this file).
export const recorded = {
  errors: [] as string[],
  infos: [] as string[],
  settings: {} as Record<string, unknown>,
};

interface StubEditor { document: { languageId: string; uri: { scheme: string; fsPath: string } } }

export const window = {
  activeTextEditor: undefined as StubEditor | undefined,
  async showErrorMessage(message: string): Promise<undefined> {
    recorded.errors.push(message);
    return undefined;
  },
  async showInformationMessage(message: string): Promise<undefined> {
    recorded.infos.push(message);
    return undefined;
  },
};

export const workspace = {
  workspaceFolders: undefined as { uri: { fsPath: string } }[] | undefined,
  getConfiguration(section: string) {
    return { get: <T>(key: string): T | undefined => recorded.settings[`${section}.${key}`] as T | undefined };
  },
};

export class DebugAdapterExecutable {
  constructor(public readonly command: string, public readonly args: string[] = []) {}
}

/** Reset between tests. */
export function resetStub(): void {
  recorded.errors.length = 0;
  recorded.infos.length = 0;
  recorded.settings = {};
  window.activeTextEditor = undefined;
  workspace.workspaceFolders = undefined;
}

export function pythonEditor(fsPath: string): StubEditor {
  return { document: { languageId: 'python', uri: { scheme: 'file', fsPath } } };
}
