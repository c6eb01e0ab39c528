// The decision queue from Node.js through the HTTP gateway (dq-gateway): plain HTTP with the built-in fetch,
// nothing to install.
//
//   node gateway.mjs [--url http://127.0.0.1:8080] [--token TOKEN]      (or DQ_GATEWAY_TOKEN)
//
// Decides one request, streams a batch's results as they land (one JSON line each), enqueues one and reads its
// result by id. Prints every result as a line; exits 0 when all are ok.

const flag = (name, fallback) => {
  const at = process.argv.indexOf(name);
  return at > 0 ? process.argv[at + 1] : fallback;
};
const base = flag('--url', 'http://127.0.0.1:8080');
const token = flag('--token', process.env.DQ_GATEWAY_TOKEN || '');
const headers = { 'content-type': 'application/json', ...(token ? { authorization: `Bearer ${token}` } : {}) };
const question = { refund: { type: 'noul', instructions: 'Is a refund requested?' } };
const request = (state) => ({ state, questions: question, metadata: { from: 'node-http' } });

async function call(method, path, body) {
  const reply = await fetch(base + path, { method, headers, body: body && JSON.stringify(body) });
  if (!reply.ok && reply.status !== 202) {
    // The status is the error class (422 invalid, 429 full: Retry-After, 504 late: the id); the body says which.
    throw new Error(`${method} ${path}: ${reply.status} ${await reply.text()}`);
  }
  return reply;
}

async function main() {
  const results = [];
  results.push(await (await call('POST', '/v1/decide', request('I was charged twice.'))).json());
  // A batch: newline-delimited JSON, one line per request as its result lands.
  const batch = await call('POST', '/v1/decide/batch', { requests: [request('Refund me'), request('All good')] });
  let buffered = '';
  for await (const chunk of batch.body) {
    buffered += Buffer.from(chunk).toString('utf8');
    let newline;
    while ((newline = buffered.indexOf('\n')) >= 0) {
      results.push(JSON.parse(buffered.slice(0, newline)));
      buffered = buffered.slice(newline + 1);
    }
  }
  const { ids } = await (await call('POST', '/v1/requests', request('Where is my parcel?'))).json();
  results.push(await (await call('GET', `/v1/results/${encodeURIComponent(ids[0])}?wait=30`)).json());
  for (const result of results) console.log(JSON.stringify(result));
  return results.every((r) => r.status === 'ok') && results.length === 4 ? 0 : 1;
}

main().then((code) => process.exit(code), (error) => { console.error(error.message); process.exit(2); });
