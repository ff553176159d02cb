// Build script: bundles the extension (Node, CommonJS, `vscode` external) and the Tensors
// panel page (browser IIFE) with esbuild; `--tests` also bundles test/*.test.ts with the
// `vscode` module replaced by test/vscode-stub.ts; `--production` minifies, no sourcemaps.
import * as esbuild from 'esbuild';
import { readdirSync } from 'node:fs';

const production = process.argv.includes('--production');
const tests = process.argv.includes('--tests');
const common = { bundle: true, logLevel: 'warning', sourcemap: !production, minify: production };

const builds = [
  esbuild.build({
    ...common, entryPoints: ['src/extension.ts'], outfile: 'out/extension.js',
    platform: 'node', format: 'cjs', target: 'node18', external: ['vscode'],
  }),
  esbuild.build({
    ...common, entryPoints: ['src/webview/main.ts'], outfile: 'out/webview.js',
    platform: 'browser', format: 'iife', target: 'es2020',
  }),
];
if (tests) {
  const entryPoints = readdirSync('test').filter((f) => f.endsWith('.test.ts')).map((f) => `test/${f}`);
  builds.push(esbuild.build({
    ...common, sourcemap: true, entryPoints, outdir: 'out/test',
    platform: 'node', format: 'cjs', target: 'node18',
    alias: { vscode: './test/vscode-stub.ts' },
  }));
}
await Promise.all(builds);
