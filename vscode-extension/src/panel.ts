// The Tensors webview panel: one at a time (createOrShow / revive / dispose), its page built
// from media/panel.html with a CSP nonce, resources only from media/ and out/, messages only
// through postMessage typed by messages.ts.
import * as vscode from 'vscode';
import { randomBytes } from 'crypto';
import { FromWebview, ToWebview, isFromWebview } from './messages';

export const VIEW_TYPE = 'mldebugTensors';
const TITLE = 'Tensors';

/** What the panel does with the page's messages (the Inspector, in extension.ts). */
export type WebviewHandler = (message: FromWebview, panel: TensorsPanel) => void;

export class TensorsPanel {
  private static instance: TensorsPanel | undefined;
  private readonly disposables: vscode.Disposable[] = [];

  /** The open panel, if any. */
  static current(): TensorsPanel | undefined {
    return TensorsPanel.instance;
  }

  /** Reveal the panel beside the editor without taking focus, creating it if needed. */
  static createOrShow(extensionUri: vscode.Uri, handler: WebviewHandler): TensorsPanel {
    if (TensorsPanel.instance) {
      TensorsPanel.instance.panel.reveal(undefined, true);
      return TensorsPanel.instance;
    }
    const panel = vscode.window.createWebviewPanel(VIEW_TYPE, TITLE,
      { viewColumn: vscode.ViewColumn.Beside, preserveFocus: true }, TensorsPanel.options(extensionUri));
    return TensorsPanel.adopt(panel, extensionUri, handler);
  }

  /** A panel VS Code restored after a reload (registerWebviewPanelSerializer). */
  static revive(panel: vscode.WebviewPanel, extensionUri: vscode.Uri, handler: WebviewHandler): TensorsPanel {
    panel.webview.options = TensorsPanel.options(extensionUri);
    return TensorsPanel.adopt(panel, extensionUri, handler);
  }

  private static options(extensionUri: vscode.Uri): vscode.WebviewPanelOptions & vscode.WebviewOptions {
    return {
      enableScripts: true,
      localResourceRoots: [vscode.Uri.joinPath(extensionUri, 'media'), vscode.Uri.joinPath(extensionUri, 'out')],
    };
  }

  private static adopt(panel: vscode.WebviewPanel, extensionUri: vscode.Uri, handler: WebviewHandler): TensorsPanel {
    TensorsPanel.instance?.dispose();
    TensorsPanel.instance = new TensorsPanel(panel, extensionUri, handler);
    return TensorsPanel.instance;
  }

  private constructor(private readonly panel: vscode.WebviewPanel, private readonly extensionUri: vscode.Uri,
    handler: WebviewHandler) {
    panel.onDidDispose(() => this.dispose(), null, this.disposables);
    panel.webview.onDidReceiveMessage((message: unknown) => {
      if (isFromWebview(message)) {
        handler(message, this);
      }
    }, null, this.disposables);
    void this.render();
  }

  post(message: ToWebview): void {
    void this.panel.webview.postMessage(message);
  }

  dispose(): void {
    if (TensorsPanel.instance === this) {
      TensorsPanel.instance = undefined;
    }
    this.panel.dispose();
    while (this.disposables.length) {
      this.disposables.pop()?.dispose();
    }
  }

  private async render(): Promise<void> {
    const webview = this.panel.webview;
    const template = new TextDecoder().decode(
      await vscode.workspace.fs.readFile(vscode.Uri.joinPath(this.extensionUri, 'media', 'panel.html')));
    webview.html = fillTemplate(template, {
      cspSource: webview.cspSource,
      nonce: randomBytes(16).toString('base64'),
      scriptUri: webview.asWebviewUri(vscode.Uri.joinPath(this.extensionUri, 'out', 'webview.js')).toString(),
      styleUri: webview.asWebviewUri(vscode.Uri.joinPath(this.extensionUri, 'media', 'panel.css')).toString(),
    });
  }
}

/** The placeholders of media/panel.html (tests/test_vscode_panel.py fills them the same way). */
export interface PageValues {
  cspSource: string;
  nonce: string;
  scriptUri: string;
  styleUri: string;
}

export function fillTemplate(template: string, values: PageValues): string {
  return template.replace(/\{\{(\w+)\}\}/g, (whole, key: string) =>
    key in values ? values[key as keyof PageValues] : whole);
}
