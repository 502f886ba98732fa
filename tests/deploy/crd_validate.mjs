// Validates ServiceMonitor (monitoring.coreos.com/v1) and Certificate (cert-manager.io/v1) manifests
// against their CRD schemas as compiled into npm @kubernetes-models/* (installed by ./dev setup).
// usage: node crd_validate.mjs NODE_MODULES_DIR < docs.json   -> prints [{kind, name, error}] as JSON
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.argv[2];
const MODELS = {
  "monitoring.coreos.com/v1/ServiceMonitor": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor.js",
  "cert-manager.io/v1/Certificate": "@kubernetes-models/cert-manager/cert-manager.io/v1/Certificate.js",
};
const docs = JSON.parse(readFileSync(0, "utf8"));
const out = [];
for (const doc of docs) {
  const key = `${doc.apiVersion}/${doc.kind}`;
  if (!(key in MODELS)) {
    out.push({ kind: key, name: doc.metadata?.name, error: "no schema for this kind" });
    continue;
  }
  const mod = await import(pathToFileURL(join(modules, MODELS[key])).href);
  try {
    new mod[doc.kind](doc).validate();
    out.push({ kind: key, name: doc.metadata?.name, error: null });
  } catch (e) {
    out.push({ kind: key, name: doc.metadata?.name, error: String(e.message) });
  }
}
process.stdout.write(JSON.stringify(out));
