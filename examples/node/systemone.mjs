// The System One API (POST /v1/systemone, GET /v1/models) on the gateway, from Node.js with the built-in fetch:
// what any client written against that API sends, nothing to install.
//
//   node systemone.mjs [--url http://127.0.0.1:8080] [--token TOKEN] [--model NAME]
//
// Calls it four ways (plain JSON; a gzip body; an image as multipart/form-data, the request part then the part its
// asset entry names; an image inline as base64) and lists the models. Prints one JSON line per call: how it was
// sent, the status, the x-typesafe-request-id header and the body. Exits 0 when every call answered 200.
// (Node 20's zlib has no zstd, which the official Python client sends; gzip is taken as well.)
import { gzipSync } from 'node:zlib';

const flag = (name, fallback) => {
  const at = process.argv.indexOf(name);
  return at > 0 ? process.argv[at + 1] : fallback;
};
const base = flag('--url', 'http://127.0.0.1:8080');
const token = flag('--token', process.env.DQ_GATEWAY_TOKEN || 'none');  // an open gateway ignores it
const auth = { authorization: `Bearer ${token}` };
// A 16x16 red PNG.
const png = Buffer.from('iVBORw0KGgoAAAANSUhEUgAAABAAAAAQCAIAAACQkWg2AAAAGklEQVR42mO8IyLCQApgYiARjGoY1TB0NAAATz0BJHAVI'
  + 'ksAAAAASUVORK5CYII=', 'base64');
const call = {
  model: flag('--model', 'jev-latest'),
  state: { message: 'I was charged twice.', channel: 'email' },
  questions: {
    refund: { type: 'noul', instructions: 'Is a refund requested?' },
    tone: { type: 'choice', criteria: { calm: null, angry: 'An upset message' } },
    urgency: { type: 'score', criteria: ['Can wait', 'This week', { level: 'Today' }] },
  },
};
const withImage = (asset) => ({ ...call, state: { photo: 'IMG_1', note: 'see the photo' },
  questions: { red: { type: 'noul', instructions: 'Is the photo mostly red?' } }, assets: { IMG_1: asset } });

async function show(how, reply) {
  const line = { how, status: reply.status, id: reply.headers.get('x-typesafe-request-id'), body: await reply.json() };
  console.log(JSON.stringify(line));
  return line;
}

async function main() {
  const post = (headers, body) => fetch(`${base}/v1/systemone`, { method: 'POST', headers: { ...auth, ...headers }, body });
  const json = { 'content-type': 'application/json' };
  const lines = [];
  lines.push(await show('json', await post(json, JSON.stringify(call))));
  lines.push(await show('gzip', await post({ ...json, 'content-encoding': 'gzip' }, gzipSync(JSON.stringify(call)))));
  const form = new FormData();  // its own boundary and content type; the request part first
  form.append('request', new Blob([JSON.stringify(withImage({ type: 'image', part: 'photo' }))],
    { type: 'application/json' }));
  form.append('photo', new Blob([png], { type: 'image/png' }), 'red.png');
  lines.push(await show('multipart', await post({}, form)));
  const inline = withImage({ type: 'image', format: 'png', data_base64: png.toString('base64') });
  lines.push(await show('base64', await post(json, JSON.stringify(inline))));
  lines.push(await show('models', await fetch(`${base}/v1/models`, { headers: auth })));
  return lines.every((line) => line.status === 200) ? 0 : 1;
}

main().then((code) => process.exit(code), (error) => { console.error(error.message); process.exit(2); });
