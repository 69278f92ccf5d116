// Drives the server with the official `ollama` npm package (installed in .cache/npm) and
// prints what it got as one JSON object. Usage: node ollama_client.mjs <package dir> <host>
import path from "node:path";
import { pathToFileURL } from "node:url";

const [pkg, host] = process.argv.slice(2);
const { Ollama } = await import(pathToFileURL(path.join(pkg, "dist", "index.mjs")).href);
const client = new Ollama({ host });
const messages = [{ role: "user", content: "hello" }];
const options = { num_predict: 6, temperature: 0 };

const chat = await client.chat({ model: "tiny", messages, options });
let streamed = "";
let last = null;
for await (const part of await client.chat({ model: "tiny", messages, options, stream: true })) {
  streamed += part.message.content;
  last = part;
}
const generate = await client.generate({ model: "tiny", prompt: "hello", options });
const schema = {
  type: "object",
  properties: { color: { enum: ["red", "green", "blue"] } },
  required: ["color"],
  additionalProperties: false,
};
const format = await client.chat({
  model: "tiny",
  messages,
  format: schema,
  options: { num_predict: 120, temperature: 0 },
});
const list = await client.list();
const show = await client.show({ model: "tiny" });
const ps = await client.ps();
const version = await client.version();
let error = null;
try {
  await client.embed({ model: "tiny", input: "x" });
} catch (e) {
  error = { status: e.status_code, message: e.error };
}
console.log(
  JSON.stringify({ chat, streamed, last, generate, format, list, show, ps, version, error }),
);
