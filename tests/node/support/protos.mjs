// A client of lf.a2a.v1.A2AService built at run time from the repository's proto/ with
// @grpc/proto-loader, and a decoder of google.rpc.Status details, built with protobufjs.
//
// proto/lf/a2a/v1/a2a.proto imports google/api/*.proto: they come from the
// googleapis-common-protos wheel installed in the server's venv (its site-packages holds
// google/api/*.proto and google/rpc/*.proto), found by asking that venv's Python, or from
// A2A_GOOGLEAPIS_PROTOS (a directory holding google/api and google/rpc). The
// google/protobuf/*.proto it imports are bundled with protobufjs. Nothing is fetched.
import { execFileSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import path from 'node:path';

import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import protobuf from 'protobufjs';

import { PYTHON, ROOT } from './server.mjs';

const ERROR_INFO_URL = 'type.googleapis.com/google.rpc.ErrorInfo';

function googleapisDir() {
  const dir = process.env.A2A_GOOGLEAPIS_PROTOS || execFileSync(PYTHON, ['-c',
    'import os, google.api.annotations_pb2 as a; '
    + 'print(os.path.dirname(os.path.dirname(os.path.dirname(a.__file__))))'],
  { encoding: 'utf8' }).trim();
  for (const file of ['google/api/annotations.proto', 'google/rpc/status.proto']) {
    if (!existsSync(path.join(dir, file))) throw new Error(`${file} is not in ${dir}`);
  }
  return dir;
}

const GOOGLEAPIS = googleapisDir();

/** The generated service client class (proto field names in lowerCamelCase, enums as names). */
export const A2AService = (() => {
  const definition = protoLoader.loadSync('lf/a2a/v1/a2a.proto', {
    includeDirs: [path.join(ROOT, 'proto'), GOOGLEAPIS],
    enums: String,
    longs: String,
    oneofs: true, // frame.payload names the payload field that is set
    defaults: false,
  });
  return grpc.loadPackageDefinition(definition).lf.a2a.v1.A2AService;
})();

const rpcTypes = (() => {
  const root = new protobuf.Root();
  root.resolvePath = (origin, target) => {
    const local = path.join(GOOGLEAPIS, target);
    return existsSync(local) ? local : target; // google/protobuf/*: protobufjs's bundled copies
  };
  root.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto'], { keepCase: true });
  return { Status: root.lookupType('google.rpc.Status'), ErrorInfo: root.lookupType('google.rpc.ErrorInfo') };
})();

/**
 * The google.rpc.Status an error carries in `grpc-status-details-bin`, with the
 * google.rpc.ErrorInfo among its details decoded (`errorInfo`, or undefined).
 */
export function richStatus(err) {
  const [bin] = err.metadata?.get('grpc-status-details-bin') ?? [];
  if (!bin) return undefined;
  const status = rpcTypes.Status.toObject(rpcTypes.Status.decode(bin), { defaults: true });
  const any = status.details.find((d) => d.type_url === ERROR_INFO_URL);
  const errorInfo = any && rpcTypes.ErrorInfo.toObject(rpcTypes.ErrorInfo.decode(any.value), { defaults: true });
  return { ...status, errorInfo };
}
