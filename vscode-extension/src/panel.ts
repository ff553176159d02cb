// The Tensors webview panel: one at a time (createOrShow / revive / dispose), its page built
// from media/panel.html with a CSP nonce, resources only from media/ and out/ (and, once a
// graph arrives, the program's own BokehJS files, whose folder is added to the roots and the
// page rebuilt with their script tags), messages only through postMessage typed by messages.ts.
import * as vscode from 'vscode';
import { randomBytes } from 'crypto';
import { dirname } from 'path';
import { FromWebview, ToWebview, isFromWebview } from './messages';

export const VIEW_TYPE = 'mldebugTensors';
const TITLE = 'Tensors';

/** What the panel does with the page's messages (the Inspector, in extension.ts). */
export type WebviewHandler = (message: FromWebview, panel: TensorsPanel) => void;

export class TensorsPanel {
  private static instance: TensorsPanel | undefined;
  private readonly disposables: vscode.Disposable[] = [];
  private bokehJs: string[] = [];

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

  private static options(extensionUri: vscode.Uri, bokehJs: readonly string[] = []): vscode.WebviewPanelOptions & vscode.WebviewOptions {
    const bokehDirs = [...new Set(bokehJs.map((f) => dirname(f)))].map((d) => vscode.Uri.file(d));
    return {
      enableScripts: true,
      localResourceRoots: [vscode.Uri.joinPath(extensionUri, 'media'), vscode.Uri.joinPath(extensionUri, 'out'), ...bokehDirs],
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
    if (message.command === 'graph' && message.graph && this.useBokeh(message.graph.bokeh.js)) {
      return;       // the page reloads with BokehJS and says 'ready': the graph is replayed then
    }
    void this.panel.webview.postMessage(message);
  }

  /** Load the program's BokehJS (the version that wrote the graph's JSON) into the page: its
   *  folder becomes a resource root and the page is rebuilt with its script tags. True when
   *  the page reloads now; false when these files are loaded already. */
  private useBokeh(files: readonly string[]): boolean {
    if (!files.length || files.join('\n') === this.bokehJs.join('\n')) {
      return false;
    }
    this.bokehJs = [...files];
    this.panel.webview.options = TensorsPanel.options(this.extensionUri, this.bokehJs);
    void this.render();
    return true;
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
    const nonce = randomBytes(16).toString('base64');
    webview.html = fillTemplate(template, {
      cspSource: webview.cspSource,
      nonce,
      bokehScripts: scriptTags(this.bokehJs.map((f) => webview.asWebviewUri(vscode.Uri.file(f)).toString()), nonce),
      scriptUri: webview.asWebviewUri(vscode.Uri.joinPath(this.extensionUri, 'out', 'webview.js')).toString(),
      styleUri: webview.asWebviewUri(vscode.Uri.joinPath(this.extensionUri, 'media', 'panel.css')).toString(),
    });
  }
}

/** The placeholders of media/panel.html (tests/test_vscode_panel.py fills them the same way). */
export interface PageValues {
  cspSource: string;
  nonce: string;
  bokehScripts: string;        // <script> tags of BokehJS, or '' before any graph
  scriptUri: string;
  styleUri: string;
}

export function fillTemplate(template: string, values: PageValues): string {
  return template.replace(/\{\{(\w+)\}\}/g, (whole, key: string) =>
    key in values ? values[key as keyof PageValues] : whole);
}

/** Script tags for URIS carrying the page's nonce (the CSP allows nothing else). */
export function scriptTags(uris: readonly string[], nonce: string): string {
  const attr = (v: string) => v.replace(/&/g, '&amp;').replace(/"/g, '&quot;').replace(/</g, '&lt;');
  return uris.map((u) => `<script nonce="${attr(nonce)}" src="${attr(u)}"></script>`).join('\n  ');
}
